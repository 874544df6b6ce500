"""Grader speed: the sandbox's cost per program, then a ColBench-format file graded with each
ground truth as the answer.

    python bench/bench_grader.py                         # 1,000 procedural tasks
    python bench/bench_grader.py --tasks BACKEND.jsonl    # ColBench backend tasks, e.g. from the public data
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import colbench  # noqa: E402
from colbench import grade, sandbox  # noqa: E402
import evaluate  # noqa: E402
import colbench.tasks  # noqa: E402

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--tasks", default="", help="task JSONL (default: --num_tasks procedural tasks)")
p.add_argument("--num_tasks", type=int, default=1000)
p.add_argument("--programs", type=int, default=100, help="trivial programs run one after another for the per-program cost")
a = p.parse_args()
calls = [("t", "f(1)")]
sandbox.run_calls("def f(x):\n    return x", calls)  # decide the sandbox once
t0 = time.time()
for _ in range(a.programs):
    assert sandbox.run_calls("def f(x):\n    return x", calls)["t"] == ("ok", 1)
per = (time.time() - t0) / a.programs
t0 = time.time()
for _ in range(a.programs):
    subprocess.run([sandbox.SANDBOX_PYTHON, "-S", "-s", "-c", "pass"], check=True)
bare = (time.time() - t0) / a.programs
print(f"sandbox: {1000 * per:.1f} ms per program, one at a time (a bare `python -S -c pass`: {1000 * bare:.1f} ms); "
      f"mode: {' '.join(sandbox._sandbox[0][:2]) or 'no isolation'}, per-worker uid: {sandbox._sandbox[1]}")
tasks = colbench.load_tasks(a.tasks) if a.tasks else \
    [colbench.tasks.procedural_task(random.Random(i)) for i in range(a.num_tasks)]
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "t.jsonl")
    with open(path, "w") as f:
        for t in tasks:
            f.write(json.dumps({"task": t, "dialogue_history": [], "answer": t["ground_truth"]}) + "\n")
    args = evaluate.Args(input=path)
    t0 = time.time()
    rows = grade.grade_code_answers(grade.load_trajectories(path), args.timeout)
    dt = time.time() - t0
s = grade.summarize(rows)
print(f"{len(rows)} tasks graded (ground truth as answer) in {dt:.1f} s on {os.cpu_count()} cores "
      f"({len(rows) / dt:.1f} tasks/s); success {100 * s['success_rate']:.1f}%")
