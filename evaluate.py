"""Grade trajectories and print the ColBench table.

Reads:  trajectories JSONL in the released schema (only `task`, `dialogue_history` and `answer` are
        required; `task_id` and `sample` are derived when absent), e.g. rollout.py's output or the
        public offline set. Writes: the same rows plus `reward` (fraction of tests passed),
        `success`, `tests_passed`, `tests_total`, `timeouts`; optionally a summary JSON.

    python evaluate.py --input runs/test_rollouts.jsonl --output runs/test_graded.jsonl --k 4 --summary runs/test_summary.json
    python evaluate.py ... --released_semantics     # the released grader's quirks, for published numbers

Every ground truth and answer runs in a sandboxed child process (common.run_calls); the ground
truth once per task. Grading runs in parallel across cores.

Deviations from the released grader (the default):
1. Code is exec'd at module level, so top-level imports, helper functions and recursion work
   (the released grader exec'd inside a function, where they raise NameError).
2. No substring blacklist: safety comes from the sandbox, not from zeroing answers that mention
   `open(` or `import os`. `--released_semantics` restores both quirks (the blacklist is our
   approximation of the released one: common.RELEASED_BLACKLIST).
"""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tqdm import tqdm

import common


@dataclass
class Args:
    input: str
    """trajectories JSONL (released schema)"""
    output: str = ""
    """graded trajectories JSONL (default: none)"""
    task_type: str = "code"
    """code (html: frontend issue)"""
    k: int = 1
    """best-of-k: a task counts as solved when any of its first k samples succeeds"""
    summary: str = ""
    """write the table as JSON here"""
    released_semantics: bool = False
    """score with the released grader's quirks (exec inside a function, substring blacklist)"""
    timeout: float = 10.0
    """seconds for all tests of one program"""
    workers: int = 0
    """parallel gradings (0 = 2 x cores)"""


def load_trajectories(path):
    rows, counts = [], defaultdict(int)
    for line, r in common.read_jsonl(path):
        for field in ("task", "dialogue_history", "answer"):
            if field not in r:
                raise common.DataError(f"{path}:{line}: missing field '{field}' (a trajectory needs task, "
                                       f"dialogue_history and answer)")
        r["task_id"] = r.get("task_id") or common.task_id(r["task"])
        if "sample" not in r:
            r["sample"] = counts[r["task_id"]]
        counts[r["task_id"]] += 1
        rows.append(r)
    return rows


def grade_all(rows, args):
    """Adds reward/success/... to each row in place (answers of one task share one ground-truth run)."""
    tasks = {r["task_id"]: r["task"] for r in rows}
    workers = args.workers or 2 * (os.cpu_count() or 1)
    calls = lambda t: list(t["test_cases"].items())
    with ThreadPoolExecutor(workers) as pool:
        gt = dict(zip(tasks, tqdm(pool.map(lambda t: common.run_calls(t["ground_truth"], calls(t), args.timeout,
                                                                      args.released_semantics), tasks.values()),
                                  total=len(tasks), desc="ground truths")))
        grades = list(tqdm(pool.map(lambda r: common.grade_code(r["task"], r["answer"], args.timeout, args.released_semantics,
                                                                gt[r["task_id"]]), rows), total=len(rows), desc="answers"))
    for r, g in zip(rows, grades):
        r.update(reward=g["reward"], success=g["success"], tests_passed=g["passed"], tests_total=g["total"],
                 timeouts=g["timeouts"])
    return rows


def summarize(rows, k=1):
    by_task = defaultdict(list)
    for r in rows:
        by_task[r["task_id"]].append(r)
    mean = lambda xs: sum(xs) / max(len(xs), 1)
    s = {"num_trajectories": len(rows), "num_tasks": len(by_task),
         "success_rate": mean([r["success"] for r in rows]),
         "tests_passed": mean([r["reward"] for r in rows]),
         "mean_turns": mean([r.get("num_turns", sum(m["role"] == "assistant" for m in r["dialogue_history"])) for r in rows]),
         "answered_rate": mean([r.get("finish", "answered" if common.ANSWER_MARKER in json.dumps(r["dialogue_history"]) else "")
                                == "answered" for r in rows]),
         "errors": sum(r.get("finish") == "error" for r in rows),
         "timeouts": sum(r.get("timeouts", 0) > 0 for r in rows), "k": k}
    firstk = [sorted(v, key=lambda r: r["sample"])[:k] for v in by_task.values()]
    s["best_of_k_success"] = mean([any(r["success"] for r in v) for v in firstk])
    s["best_of_k_tests"] = mean([max(r["reward"] for r in v) for v in firstk])
    return s


def print_table(s, title=""):
    lines = [("trajectories", s["num_trajectories"]), ("tasks", s["num_tasks"]),
             ("success rate", f"{100 * s['success_rate']:.1f}%"), ("% tests passed", f"{100 * s['tests_passed']:.1f}%")]
    if s["k"] > 1:
        lines += [(f"best-of-{s['k']} success", f"{100 * s['best_of_k_success']:.1f}%"),
                  (f"best-of-{s['k']} tests", f"{100 * s['best_of_k_tests']:.1f}%")]
    lines += [("mean agent turns", f"{s['mean_turns']:.2f}"), ("answered with marker", f"{100 * s['answered_rate']:.1f}%"),
              ("trajectories with a timed-out/crashed test", s["timeouts"]), ("rollout errors", s["errors"])]
    print(f"\n{title or 'ColBench backend'}")
    for name, v in lines:
        print(f"  {name:<44} {v}")


def main(args):
    if args.task_type != "code":
        sys.exit(f"--task_type {args.task_type}: only 'code' is implemented so far")
    rows = grade_all(load_trajectories(args.input), args)
    if args.output:
        common.write_jsonl(args.output, rows)
    s = summarize(rows, args.k)
    s["released_semantics"] = args.released_semantics
    print_table(s, f"ColBench backend: {args.input}")
    if args.summary:
        os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
        with open(args.summary, "w") as f:
            json.dump(s, f, indent=2)
    return s


if __name__ == "__main__":
    main(common.parse_args(Args, __doc__))
