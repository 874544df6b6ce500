"""Turn credit of critic variants and rankings, scored on the same labelled candidates of a finished run.

    python bench/rescore_credit.py --run runs/default --critics lr1e-4=runs/default/critic,lr1e-6=DIR,...

Reads RUN/pairs.jsonl.states.jsonl (label_turns.py's candidates), RUN/pairs.jsonl.classes.jsonl (credit.py's true
classes and grades) and RUN/train_graded.jsonl. For every candidate a of a state o it computes once, and keeps in
RUN/rescore/*.jsonl so that a later call with more critics scores only those:
    log pi_ref(a | c, o) and log pi_ref(a | o)   (sums and token counts; pi_ref also sampled the candidates)
    log pi_critic(a | c, o) for each critic
and ranks the candidates of each state by
    paper:    mean over a's tokens of [log pi_critic(a | c, o) - log pi_ref(a | c, o)]   (equation 3)
    released: mean log pi_critic(a | c, o) - mean log pi_ref(a | o)   (the release's rank_best_of_n: the sampler's
              own log-probs, recorded without c)
    pmi:      mean log pi_ref(a | c, o) - mean log pi_ref(a | o)   (no critic: how much c makes a likely)
It prints credit.py's class pairs by kind (good answer > bad question, ..., on pages also good answer > bad draft,
good draft > bad question, ...) and the exact answer pairs for each
critic and ranking, and writes them to RUN/rescore/report.json. A critic variant costs its training and one
forward over the candidates (about 3 min for 135 states x 8 candidates on 2 cores), not a run.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import colbench  # noqa: E402
import common  # noqa: E402
import credit  # noqa: E402
from machinery import models  # noqa: E402
from train_critic import load_critic, training_info, turn_advantage  # noqa: E402

KINDS = ("good answer > bad question", "good question > bad answer", "good answer > bad answer",
         "good question > bad question")  # then, on pages, the draft kinds (good answer > bad draft, ...) that occur


def logprobs(model, tok, prefix, prompt, candidates, max_len):
    ids, conts = common.encode_shared(tok, prefix, prompt, candidates, max_len)
    s, n = common.shared_prompt_logprobs(model, ids, conts, max_tokens=65536)
    return s.tolist(), n.tolist()


def cached_scores(path, states, trajs, name, tok, with_c, max_len):
    """{state key: ([sum], [count])} of every candidate under the model `name`, given c + o (with_c) or o alone,
    kept in path: a rerun loads the model only for the states still missing."""
    key = lambda r: (r["task_id"], r["sample"], r["turn"])
    out = common.ResumableWriter(Path(path), key)
    todo = [s for s in states if not out.finished(key(s))]
    model = models.load_model(name, torch.device("cpu")).eval() if todo else None
    for s in common.tqdm_if(todo, bool(todo), Path(path).stem):
        task = trajs[(s["task_id"], s["sample"])]["task"]
        with torch.no_grad():
            sums, counts = logprobs(model, tok, training_info(task) if with_c else "", s["prompt"], s["candidates"],
                                    max_len)
        out.write({"task_id": s["task_id"], "sample": s["sample"], "turn": s["turn"], "sums": sums, "counts": counts})
    out.close()
    return {key(r): (r["sums"], r["counts"]) for _, r in common.read_jsonl(path)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a run directory with pairs.jsonl.states.jsonl and its classes")
    p.add_argument("--critics", required=True, help="NAME=DIR,...: train_critic.py outputs from one pi_ref")
    p.add_argument("--max_len", type=int, default=16384, help="longest prompt + candidate (label_turns.py's)")
    args = p.parse_args()
    run, out = Path(args.run), Path(args.run) / "rescore"
    out.mkdir(exist_ok=True)
    critics = dict(kv.split("=", 1) for kv in args.critics.split(","))
    states = credit.labelled_states(run / "pairs.jsonl")
    trajs = {(t["task_id"], t.get("sample", 0)): t for _, t in common.read_jsonl(run / "train_graded.jsonl")}
    for s in states:  # the state o_t: the stored agent input at that turn, as label_turns.py read it
        s["prompt"] = colbench.agent_turns(trajs[(s["task_id"], s["sample"])])[s["turn"]][0]
    torch.set_grad_enabled(False)
    ref_name = load_critic(next(iter(critics.values())))[1]
    tok = models.load_tokenizer(ref_name)
    ref_c = cached_scores(out / "ref_given_c.jsonl", states, trajs, ref_name, tok, True, args.max_len)
    ref_o = cached_scores(out / "ref_given_o.jsonl", states, trajs, ref_name, tok, False, args.max_len)
    by_critic = {name: cached_scores(out / f"critic_{name}.jsonl", states, trajs, d, tok, True, args.max_len)
                 for name, d in critics.items()}
    A = lambda logp, ref, k: turn_advantage(torch.tensor(logp[k][0]), torch.tensor(ref[k][0]),
                                            torch.tensor(logp[k][1]), 1.0).tolist()  # the critic block's, beta 1
    for s in states:
        k = (s["task_id"], s["sample"], s["turn"])
        forms = {"pmi": A(ref_c, ref_o, k)}  # pi_ref given c against pi_ref given o: no critic
        for name in critics:
            forms[f"{name}/paper"] = A(by_critic[name], ref_c, k)
            forms[f"{name}/released"] = A(by_critic[name], ref_o, k)
        s["advantages_by_critic"] = forms
    names = list(states[0]["advantages_by_critic"])
    acc = credit.accuracies(states, names)
    exact = credit.decided_report(states, {}, names)
    report = {"states": len(states), "by_kind": acc["by_kind"], "kind_order": acc["kind_order"],
              "exact_pairs": exact["credit_pairs"], "exact_accuracy": exact["credit_accuracy"],
              "exact_ci95": exact["credit_accuracy_ci95"], "mean_log_ratio": {}}
    for name in critics:  # mean per-token log pi_critic - log pi_ref (both given c) by true class and kind
        groups = {}
        for s in states:
            lr = s["advantages_by_critic"][f"{name}/paper"]
            for i, cls in enumerate(s.get("classes") or []):
                groups.setdefault(f"{cls} {colbench.turn_kind(s['candidates'][i])}", []).append(lr[i])
        report["mean_log_ratio"][name] = {g: round(sum(v) / len(v), 3) for g, v in sorted(groups.items())}
    common.write_text(out / "report.json", json.dumps(report, indent=2))
    width, f3 = max(len(n) for n in names), lambda v: "-" if v is None else f"{v:.3f}"
    print(f"{len(states)} states; class pairs by kind (pairs), exact answer pairs ({report['exact_pairs']}); "
          + (credit.kind_order_line(acc["kind_order"]) or "no class pairs"))
    kinds = [*KINDS, *sorted(k for k in acc["by_kind"][names[0]] if k not in KINDS)]
    print(" " * width + " | " + " | ".join(f"{k} ({acc['by_kind'][names[0]].get(k, [0, 0])[1]})" for k in kinds)
          + " | exact")
    for n in names:
        row = [acc["by_kind"][n].get(k, [None])[0] for k in kinds]
        print(f"{n:<{width}} | " + " | ".join(f3(v).center(len(k) + 6) for v, k in zip(row, kinds))
              + f" | {f3(exact['credit_accuracy'][n])}")
    for name, g in report["mean_log_ratio"].items():
        print(f"mean per-token log-ratio, {name}: " + ", ".join(f"{k} {v:+.2f}" for k, v in g.items()))


if __name__ == "__main__":
    main()
