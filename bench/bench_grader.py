"""Grader speed: a ColBench-format file graded with each ground truth as the answer.

    python bench/bench_grader.py                         # 1,000 procedural tasks
    python bench/bench_grader.py --tasks ../shared/colbench-sample/backend_sample.jsonl
"""
import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import common  # noqa: E402
import evaluate  # noqa: E402
import generate_tasks  # noqa: E402

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--tasks", default="", help="task JSONL (default: --num_tasks procedural tasks)")
p.add_argument("--num_tasks", type=int, default=1000)
a = p.parse_args()
tasks = common.load_tasks(a.tasks) if a.tasks else \
    [generate_tasks.procedural_task(random.Random(i)) for i in range(a.num_tasks)]
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "t.jsonl")
    with open(path, "w") as f:
        for t in tasks:
            f.write(json.dumps({"task": t, "dialogue_history": [], "answer": t["ground_truth"]}) + "\n")
    args = evaluate.Args(input=path)
    t0 = time.time()
    rows = evaluate.grade_all(evaluate.load_trajectories(path), args)
    dt = time.time() - t0
s = evaluate.summarize(rows)
print(f"{len(rows)} tasks graded (ground truth as answer) in {dt:.1f} s on {os.cpu_count()} cores "
      f"({len(rows) / dt:.1f} tasks/s); success {100 * s['success_rate']:.1f}%")
