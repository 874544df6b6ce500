"""The frozen layers run once (common.FrozenBottom) against the whole model at every pass, on a finished
run.sh run directory: (1) critic steps (forward + backward of the Bradley-Terry loss) on the first
--pairs trajectory pairs of the run's train rollouts, the top --train_layers layers trained; (2) label
scoring (label_turns.Scorer: every critic and pi_ref) of the first --states stored states. The two
variants alternate on the same inputs, so a busy machine slows both alike. Reports seconds per
round, the ratio, and the largest difference in scores.

    python bench/bench_frozen.py --run runs/default --task_type html
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import colbench  # noqa: E402
import common  # noqa: E402
import label_turns  # noqa: E402
import models  # noqa: E402
import train_critic  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--run", required=True, help="a run.sh run directory (train_graded.jsonl, policy_warm, critic, pairs.jsonl.states.jsonl)")
p.add_argument("--task_type", default="code")
p.add_argument("--pairs", type=int, default=6)
p.add_argument("--states", type=int, default=8)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--train_layers", type=int, default=10)
a = p.parse_args()
run = lambda *x: os.path.join(a.run, *x)
torch.manual_seed(0)
cpu = torch.device("cpu")

# (1) critic steps
tok = models.load_tokenizer(run("policy_warm"))
pairs = colbench.trajectory_pairs(colbench.load_graded(run("train_graded.jsonl")), a.task_type)[:a.pairs]
for t in {id(t): t for pair in pairs for t in pair}.values():
    t["turns"] = colbench.agent_turns(t)
    t["seqs"] = common.tokenize_turns(tok, t["turns"], train_critic.training_info(t["task"]), 8192)
model = models.load_model(run("policy_warm"), cpu, False, torch.float32, a.train_layers)
bottom = common.FrozenBottom(model, a.train_layers)
trajs = lambda pair: [(t["seqs"], len(t["turns"])) for t in pair]


def steps(b):
    start, losses = time.time(), []
    for pair in pairs:
        res = common.shared_prefix_turn_logprobs(model, trajs(pair), bottom=b)
        scores = [train_critic.trajectory_score(s, torch.zeros_like(s), n, 0.1) for s, n in res]
        loss = train_critic.critic_loss(scores[0], scores[1])
        loss.backward()
        losses.append(loss.item())
    model.zero_grad()
    return time.time() - start, losses


t0 = time.time()
with torch.no_grad():
    for pair in pairs:  # pi_ref's pass keeps the frozen layers' output
        common.shared_prefix_turn_logprobs(model, trajs(pair), bottom=bottom)
print(f"critic: {len(pairs)} pairs, {sum(len(t['seqs'][0][0]) for pair in pairs for t in pair)} tokens; "
      f"keeping the frozen layers' output: {time.time() - t0:.1f} s", flush=True)
for r in range(a.rounds):
    (whole, lw), (kept, lk) = steps(None), steps(bottom)
    print(f"  round {r + 1}: whole model {whole:.1f} s, frozen layers kept {kept:.1f} s ({whole / kept:.2f}x); "
          f"largest loss difference {max(abs(x - y) for x, y in zip(lw, lk)):.1e}", flush=True)
del model, bottom

# (2) label scoring
dirs = {"sweet": run("critic")}
if os.path.exists(run("critic_no_training_info")):
    dirs["no_training_info"] = run("critic_no_training_info")
settings, ref_name = label_turns.load_critics(dirs)
scorers = {keep: label_turns.Scorer.load(dirs, settings, ref_name, cpu, 16384, 10, 65536, keep) for keep in (False, True)}
if scorers[True].bottom is None:
    sys.exit("the critics do not share pi_ref's bottom layers (trained without --train_layers?)")
states = [r for _, r in common.read_jsonl(run("pairs.jsonl.states.jsonl"))][:a.states]
graded = {(t["task_id"], t.get("sample", 0)): t for t in colbench.load_graded(run("train_graded.jsonl"))}
seconds, diff = {False: [], True: []}, 0.0
for s in states:
    traj = graded[(s["task_id"], s["sample"])]
    prompt = colbench.agent_turns(traj)[s["turn"]][0]
    out = {}
    for keep, scorer in scorers.items():
        t0 = time.time()
        out[keep] = scorer.advantages(traj["task"], prompt, s["candidates"])
        seconds[keep].append(time.time() - t0)
    diff = max(diff, *(abs(x - y) for k in dirs for x, y in zip(out[True][k], out[False][k])))
whole, kept = sum(seconds[False][1:]), sum(seconds[True][1:])
print(f"label scoring: {len(states)} states x {len(states[0]['candidates'])} candidates, critics {', '.join(dirs)} and pi_ref; "
      f"states 2-{len(states)}: whole models {whole:.1f} s, frozen layers once {kept:.1f} s ({whole / kept:.2f}x); "
      f"first state {seconds[False][0]:.1f} / {seconds[True][0]:.1f} s (the one-time check); "
      f"largest advantage difference {diff:.1e}", flush=True)
