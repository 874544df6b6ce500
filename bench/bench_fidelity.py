"""Grader fidelity: our grader against a reference with the released grader's semantics, on the
ground truths of a ColBench-format task file and on mutated answers made from them.

    python bench/bench_fidelity.py --tasks BACKEND.jsonl    # ColBench backend tasks, e.g. from the public data

The reference is the released comparison (exec inside a function, eval the test, `gt == answer and
gt is not None`, a ValueError is a miss), written here and run inside our sandbox, one process per
(task, answer) holding both programs, so no untrusted code runs in this process either. It leaves
out the released 1 s alarm. Last line: one JSON object with the success rates and agreements.
"""
import argparse
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import colbench  # noqa: E402
from colbench import sandbox  # noqa: E402

REFERENCE = '''
def reference(gt_src, answer_src, tests):
    def output(src, test):
        try:
            exec(src)
            return eval(test)
        except Exception:
            return None
    passed = 0
    for test in tests:
        g, a = output(gt_src, test), output(answer_src, test)
        try:
            passed += bool(g == a and g is not None)
        except ValueError:
            pass
    return passed == len(tests)
'''


def mutants(code):
    """Wrong answers a model might write: a constant changed, a comparison flipped, None returned."""
    out = []
    m = re.search(r"(?<![\w.])(\d+)(?![\w.])", code)
    if m:
        out.append(code[:m.start()] + str(int(m.group(1)) + 1) + code[m.end():])
    for a, b in ((" < ", " <= "), (" > ", " >= "), (" == ", " != "), (" + ", " - ")):
        if a in code:
            out.append(code.replace(a, b, 1))
            break
    out.append(re.sub(r"^(\s*)return\b.*$", r"\1return None", code, count=1, flags=re.M))
    return [c for c in out if c != code]


def judge(task, answer, timeout):
    tests = list(task["test_cases"].values())
    ref = sandbox.run_calls(REFERENCE + f"\nRESULT = reference({task['ground_truth']!r}, {answer!r}, {tests!r})\n",
                            [("r", "RESULT")], timeout=timeout * (len(tests) + 1), trusted=True)["r"]
    ours = sandbox.grade_code(task, answer, timeout)
    released = sandbox.grade_code(task, answer, timeout, released=True)
    return ref == ("ok", True), ours["success"], released["success"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", required=True, help="ColBench-format backend task JSONL (or a datasets folder)")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=2 * (os.cpu_count() or 1))
    a = p.parse_args()
    tasks = colbench.load_tasks(a.tasks)
    jobs = [(t, t["ground_truth"], True) for t in tasks] + [(t, m, False) for t in tasks for m in mutants(t["ground_truth"])]
    with ThreadPoolExecutor(a.workers) as pool:
        res = list(pool.map(lambda j: judge(j[0], j[1], a.timeout), jobs))
    gt = [r for r, (_, _, is_gt) in zip(res, jobs) if is_gt]
    for (ref, ours, rel), (t, ans, is_gt) in zip(res, jobs):
        if ref != ours:
            print(f"disagree ({'ground truth' if is_gt else 'mutant'}) {t['task_id']}: reference {ref}, ours {ours}")
    out = {"tasks": len(tasks), "answers": len(jobs),
           "gt_success_reference": sum(r[0] for r in gt) / len(gt), "gt_success_ours": sum(r[1] for r in gt) / len(gt),
           "gt_success_ours_released": sum(r[2] for r in gt) / len(gt),
           "agreement_ours": sum(r[0] == r[1] for r in res) / len(res),
           "agreement_ours_released": sum(r[0] == r[2] for r in res) / len(res)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
