"""How far can a critic of this reward get on turn credit? Each labelled candidate turn's value by Monte
Carlo: the dialogue goes on after it with the policy that sampled the candidates (rollout.py --prefixes),
is graded (evaluate.py), and the candidate's value Q(state, turn) is the mean reward of its continuations
(an answer ends the dialogue: one grade). Ordered by Q, the candidates get a turn-credit accuracy
(credit.py) that no critic learning this reward's advantages under this policy should beat by much:
where it falls short of the true classes, the classes ask for more than the reward says.

    python bench/mc_credit.py --pairs runs/default/pairs.jsonl --trajectories runs/default/train_graded.jsonl \\
        --policy runs/default/policy_warm --task_type html --output_dir runs/default/mc_credit

Writes OUTPUT_DIR/prefixes.jsonl, continuations.jsonl (+ _graded) and mc_credit.json: the accuracy by
Q on reward (similarity on html, tests passed on code), on success (exact design, all tests), on success
with reward breaking ties, and the stored critics' on the same states, each split by turn kind. Reruns resume (rollout.py and evaluate.py
skip finished work). Cost: 48 html states x 4 continuations (822 dialogues) took 57 min on 2 CPU cores.
"""
import argparse
import json
import os
import random
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import colbench  # noqa: E402
import common  # noqa: E402
import credit  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--pairs", required=True, help="label_turns.py's output; its .states.jsonl holds the candidates and classes")
p.add_argument("--trajectories", required=True, help="the graded dialogues label_turns.py read (the states' dialogues)")
p.add_argument("--policy", required=True, help="the policy that sampled the candidates (run.sh: the starting policy, pi_ref)")
p.add_argument("--output_dir", required=True)
p.add_argument("--task_type", default="code", choices=["code", "html"])
p.add_argument("--num_states", type=int, default=48, help="labelled states with both classes, drawn at random")
p.add_argument("--continuations", type=int, default=4, help="dialogues after each candidate that is not an answer")
p.add_argument("--max_turns", type=int, default=10)
p.add_argument("--simulator_url", default="", help="empty: start the scripted human")
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()
a.output_dir = os.path.abspath(a.output_dir)  # rollout.py and evaluate.py run in the project's folder
if os.path.exists(a.policy):
    a.policy = os.path.abspath(a.policy)

settings = json.load(open(f"{a.pairs}.run_settings.json"))  # the labelling's sampling settings, continued alike
trajs = {(t["task_id"], t["sample"]): t for t in colbench.load_graded(a.trajectories)}
states = [r for _, r in common.read_jsonl(f"{a.pairs}.states.jsonl") if len(set(r.get("classes") or [])) > 1]
random.Random(a.seed).shuffle(states)
states = states[: a.num_states]
common.refuse(not states and f"{a.pairs}.states.jsonl: no labelled state with both a good and a bad candidate")

os.makedirs(a.output_dir, exist_ok=True)
prefixes, which = [], []  # which[sample] = (state index, candidate index)
for si, s in enumerate(states):
    t = trajs[(s["task_id"], s["sample"])]
    before = credit.state_dialogue(t, s["turn"])
    for ci, c in enumerate(s["candidates"]):
        content, stored = colbench.split_output(c)
        for _ in range(1 if colbench.ANSWER_MARKER in content else a.continuations):
            prefixes.append({"task": t["task"], "sample": len(which),
                             "dialogue_history": before + [{"role": "assistant", "content": content, "output": stored}]})
            which.append((si, ci))
common.write_jsonl(f"{a.output_dir}/prefixes.jsonl", prefixes)
print(f"{len(states)} states, {len(prefixes)} dialogues to continue or grade", file=sys.stderr)

py = sys.executable
server = None
url = a.simulator_url
if not url:
    server = subprocess.Popen([py, "simulator.py", "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    url = server.stdout.readline().split("ready at ")[1].strip().removesuffix("/v1")
try:
    out = f"{a.output_dir}/continuations.jsonl"
    subprocess.run([py, "rollout.py", "--prefixes", f"{a.output_dir}/prefixes.jsonl", "--output", out, "--task_type", a.task_type,
                    "--agent_model", a.policy, "--simulator_url", url, "--temperature", str(settings["temperature"]),
                    "--top_p", str(settings["top_p"]), "--max_new_tokens", str(settings["max_new_tokens"]),
                    "--max_turns", str(a.max_turns),
                    "--batch_size", "64", "--seed", str(a.seed)], cwd=ROOT, check=True)
    graded = f"{a.output_dir}/continuations_graded.jsonl"
    if not os.path.exists(graded):
        subprocess.run([py, "evaluate.py", "--input", out, "--output", graded, "--task_type", a.task_type], cwd=ROOT, check=True)
finally:
    if server is not None:
        server.terminate()

rewards, successes = [[[] for _ in s["candidates"]] for s in states], [[[] for _ in s["candidates"]] for s in states]
for _, r in common.read_jsonl(graded):
    si, ci = which[r["sample"]]
    rewards[si][ci].append(r["reward"])
    successes[si][ci].append(float(r["success"]))
mean = lambda xs: sum(xs) / len(xs)
for s, rw, sc in zip(states, rewards, successes):
    s["advantages_by_critic"]["mc_reward"] = [mean(x) for x in rw]
    s["advantages_by_critic"]["mc_success"] = [mean(x) for x in sc]
    s["advantages_by_critic"]["mc_success_then_reward"] = [mean(x) + 1e-3 * mean(y) for x, y in zip(sc, rw)]
    s["advantages_by_critic"]["untrained"] = [0.0] * len(rw)  # pi_ref: every turn's advantage 0, as label_turns reports it
names = ["mc_reward", "mc_success", "mc_success_then_reward"] + [n for n in states[0]["advantages_by_critic"]
                                                                 if not n.startswith("mc_") and n != "untrained"]
result = {"states": len(states), "continuations": a.continuations, "policy": a.policy, **credit.accuracies(states, names)}
common.write_text(f"{a.output_dir}/mc_credit.json", json.dumps(result, indent=2))
print(f"turn-credit accuracy on {len(states)} states ({result['class_pairs']['mc_reward']} class pairs): "
      + credit.accuracy_line(result["credit_accuracy"]) + "; " + credit.kind_order_line(result["kind_order"]))
for kind, (_, n) in result["by_kind"]["mc_reward"].items():
    print(f"  {kind} ({n}): " + ", ".join(f"{name} {result['by_kind'][name][kind][0]:.2f}" for name in names))
