"""label_turns scoring in another precision (--score_dtype), on a finished run.sh run directory: the
stored candidates of its labelled states are scored again by its critics and pi_ref (label_turns.Scorer,
the frozen layers shared) in each dtype given. Reports, per dtype, the seconds it took, the largest
advantage difference from the stored ones, how many of the stored advantages' pairs (label_turns.make_pairs,
the same random tie order) the new advantages keep, and every critic's turn-credit accuracy (credit.py)
beside the stored one. The stored advantages are those of the run's own --score_dtype (its
pairs.jsonl.run_settings.json). Run it from the folder run.sh ran in (the critics name pi_ref by the
path they were trained from).

    python bench/bench_score.py --run runs/default --dtypes float32,bfloat16 --states 40
"""
import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import colbench  # noqa: E402
import credit  # noqa: E402
import label_turns  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--run", required=True, help="a run.sh run directory (train_graded.jsonl, critic, pairs.jsonl.states.jsonl)")
p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated --score_dtype values to time")
p.add_argument("--states", type=int, default=0, help="the first N labelled states (0: all)")
p.add_argument("--pairs_per_state", type=int, default=4)
a = p.parse_args()
run = lambda *x: os.path.join(a.run, *x)
torch.manual_seed(0)

stored = [json.loads(line) for line in open(run("pairs.jsonl.states.jsonl"))]
stored = stored[:a.states or len(stored)]
names = list(stored[0].get("advantages_by_critic") or {"sweet": None})
dirs = {"sweet": run("critic"), **{n: run(f"critic_{n}") for n in names if n != "sweet"}}
settings, ref_name = label_turns.load_critics(dirs)
if ref_name.startswith("runs/") and not os.path.exists(ref_name):
    sys.exit(f"error: the critics' pi_ref {ref_name} is not here: run this from the folder run.sh ran in")
graded = {(t["task_id"], t.get("sample", 0)): t for t in colbench.load_graded(run("train_graded.jsonl"))}
label_settings = json.load(open(run("pairs.jsonl.run_settings.json")))
print(f"{len(stored)} states of {a.run}, critics {', '.join(dirs)}; stored advantages scored with "
      f"--score_dtype {label_settings.get('score_dtype', 'auto (before the flag)')}")
if stored[0].get("classes"):
    print(f"stored: turn-credit {credit.accuracy_line(credit.accuracies(stored, names)['credit_accuracy'])}")

for dtype in a.dtypes.split(","):
    scorer = label_turns.Scorer.load(dirs, settings, ref_name, torch.device("cpu"), 16384, 10, 65536, dtype=dtype)
    start, rows, kept, total, diff = time.time(), [], 0, 0, 0.0
    for i, s in enumerate(stored):
        traj = graded[(s["task_id"], s["sample"])]
        prompt = colbench.agent_turns(traj)[s["turn"]][0]
        adv = scorer.advantages(traj["task"], prompt, s["candidates"])
        before = label_turns.make_pairs(s["candidates"], s["advantages"], a.pairs_per_state, random.Random(i))
        after = label_turns.make_pairs(s["candidates"], adv["sweet"], a.pairs_per_state, random.Random(i))
        kept, total = kept + len(set(before) & set(after)), total + len(before)
        diff = max(diff, *(abs(x - y) for x, y in zip(adv["sweet"], s["advantages"])))
        rows.append({**s, "advantages": adv["sweet"], "advantages_by_critic": adv})
    seconds = time.time() - start
    line = (f"{dtype}: {seconds:.0f} s ({seconds / len(stored):.2f} s a state), largest advantage difference {diff:.1e}, "
            f"pairs kept {kept}/{total}")
    if stored[0].get("classes"):
        line += f", turn-credit {credit.accuracy_line(credit.accuracies(rows, names)['credit_accuracy'])}"
    print(line, flush=True)
