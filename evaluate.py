"""Grade trajectories and print the ColBench table; or compare graded runs with paired intervals.

Reads:  trajectories JSONL in the released schema (task, dialogue_history and answer; task_id and
        sample derived when absent). Writes: the same rows plus reward (share of tests passed; html:
        the similarity of the rendered answer and target), success, tests_passed, tests_total,
        timeouts and verdicts (pass | wrong | exception | timeout | crash | unencodable |
        infrastructure, per test); optionally a summary JSON.

    python evaluate.py --input runs/test_rollouts.jsonl --output runs/test_graded.jsonl --k 4 --summary runs/s.json
    python evaluate.py ... --released_semantics     # the released grader's quirks, for published numbers
    python evaluate.py --compare zero_shot=A_GRADED,sweet_rl=B_GRADED --summary runs/results.json
    python evaluate.py --compare zero_shot=A0+A1+A2,sweet_rl=B0+B1+B2   # pooled over draws (NAME=draw+draw)

Grading is colbench/grade.py's: every ground truth (once a task) and answer runs in a sandboxed child process;
no substring blacklist applies (the released grader's quirks: --released_semantics; docs/grader.md).
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import colbench
import common
from colbench import grade


@dataclass
class Args:
    input: str = ""
    """trajectories JSONL (released schema) to grade"""
    output: str = ""
    """graded trajectories JSONL (default: none)"""
    task_type: str = "code"
    """code (unit tests) | html (image similarity of the rendered answer and target)"""
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
    clip_model: str = ""
    """html: a CLIP model path or id (e.g. openai/clip-vit-base-patch32); empty = the non-CLIP fallback metric"""
    reference: str = ""
    """html: graded trajectories of a reference run; reports this run's win rate against it"""
    compare: str = ""
    """instead of grading: NAME=GRADED,... graded runs on the same tasks (the first is the baseline); writes
    success with 95% bootstrap intervals and paired differences to the first to --summary; NAME=A+B+...
    pools draws, the i-th file of every NAME from the same draw (tasks are resampled across the draws)"""
    policies: str = ""
    """with --compare: NAME=DIR,... the checkpoint each run used (recorded in the results)"""
    credit: str = ""
    """with --compare: label_turns.py's PAIRS: the turn credit of each critic from credit.py's PAIRS.credit.json"""
    select: bool = False
    """with --compare: also pick the run with the highest success (ColBench pages: similarity; the first listed wins
    a tie) as `selected`, `selected_policy` and `selected_by` in --summary (run.sh: selection on validation tasks)"""


BOOTSTRAP = 10000  # resamples of every interval


def bootstrap_ci(values, n_boot=BOOTSTRAP, seed=0):
    """95% percentile interval of the mean of per-task values, resampling tasks with replacement."""
    import numpy as np
    x = np.asarray(values, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(x), size=(n_boot, len(x)))  # [n_boot, n_tasks]
    means = x[idx].mean(axis=1)
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def training_of(policy):
    """{"training": ...}: how train_dpo.py made POLICY (its run_settings.json): the mode, the steps of the run and
    the step this checkpoint holds, the batch, the learning rate and the loss's settings. {} for another model."""
    f = Path(policy or "/") / "run_settings.json"
    s = json.loads(f.read_text()) if f.is_file() else {}
    keys = ("mode", "sft_on", "steps", "step", "batch_size", "lr", "beta", "nll_coef")
    return {"training": {k: s[k] for k in keys if k in s}} if "mode" in s else {}


def compare(args):
    """Each method's score with a 95% bootstrap interval over tasks, and its paired difference to the first
    method on the same tasks with its own interval. Code: success (mean over tasks of the per-task success
    rate). Frontend: similarity (per-task mean), the win rate against the first method (tasks where it is
    higher, ties half) with its interval, and the exact designs (success) paired where pages have design facts."""
    common.check_writable(args.summary)
    runs = dict(kv.split("=", 1) for kv in args.compare.split(","))
    policies = dict(kv.split("=", 1) for kv in args.policies.split(",") if kv)
    if len({spec.count("+") for spec in runs.values()}) > 1:
        raise common.DataError(f"--compare {args.compare}: every NAME needs as many draws (files joined by +)")
    per_task, tests, outcomes, exact, exact_task, metric, length = {}, {}, {}, {}, {}, None, {}
    for name, spec in runs.items():
        rows, by = [], defaultdict(list)
        for draw, path in enumerate(spec.split("+")):  # NAME=A+B+C pools draws: a task is (draw, task)
            part = [r for _, r in common.read_jsonl(path)]
            html = bool(part) and "metric" in part[0]  # frontend rows name their similarity metric
            for line, r in enumerate(part, 1):
                if ("metric" if html else "success") not in r:
                    raise common.DataError(f"{path}:{line}: missing '{'metric' if html else 'success'}' "
                                           f"(pass graded trajectories from evaluate.py)")
                if r.get("metric", "success") != (metric or part[0].get("metric", "success")):
                    raise common.DataError(f"{path}:{line}: scored with {r.get('metric', 'unit tests')}, not "
                                           f"{metric or part[0].get('metric', 'unit tests')}: not comparable")
                by[(draw, r.get("task_id") or colbench.task_id(r["task"]))].append(r)
            metric = part[0]["metric"] if html else "success"
            rows += part
        if all("family" in r["task"] for r in rows):  # procedural code tasks: where the dialogues ended
            outcomes[name] = dict(Counter(colbench.dialogue_outcome(r) for r in rows))
        value = grade.similarity if html else (lambda r: float(bool(r["success"])))
        per_task[name] = {t: sum(map(value, v)) / len(v) for t, v in by.items()}
        tests[name] = sum(r["reward"] for r in rows) / len(rows)
        length[name] = {"mean_turns": sum(map(colbench.num_agent_turns, rows)) / len(rows),  # how long they ran,
                        "answered_rate": sum(map(grade.answered, rows)) / len(rows)}   # and how many answered at all
        if html and all("exact_design" in r for r in rows):
            exact[name] = sum(r["exact_design"] for r in rows) / len(rows)
            exact_task[name] = {t: sum(r["exact_design"] for r in v) / len(v) for t, v in by.items()}
        if html:  # dialogues with no page to grade (most ran out of turns asking): scored as an empty page
            length[name]["no_page"] = sum(not r.get("answer") for r in rows)
    html = metric != "success"
    score = "similarity" if html else "success"
    base = next(iter(runs))
    tasks = sorted(set.intersection(*(set(v) for v in per_task.values())))
    if not tasks:
        raise common.DataError("--compare: the runs share no task")
    paired = {}  # NAME -> difference to the first method (the baseline, zero_shot in run.sh)
    res = {"num_test_tasks": len(tasks), **({"metric": metric} if html else {}), "methods": {},
           f"paired_vs_{base}": paired}
    for other in list(runs)[1:]:  # every other method against every other (e.g. paired_vs_multi_turn_dpo)
        diff = lambda name: [per_task[name][t] - per_task[other][t] for t in tasks]
        res[f"paired_vs_{other}"] = {name: {"diff": sum(diff(name)) / len(tasks),
                                            "ci95": bootstrap_ci(diff(name))}
                                     for name in runs if name != other}
    for name in runs:
        xs = [per_task[name][t] for t in tasks]
        last = {"exact_design": exact[name]} if name in exact else {} if html else {"tests_passed": tests[name]}
        res["methods"][name] = {score: sum(xs) / len(xs), "ci95": bootstrap_ci(xs), **last,
                                "policy": policies.get(name, ""), **training_of(policies.get(name))}
        if name in outcomes:
            res["methods"][name]["outcomes"] = outcomes[name]
        res["methods"][name].update(length[name])
        if name != base:
            d = [per_task[name][t] - per_task[base][t] for t in tasks]
            paired[name] = {"diff": sum(d) / len(d), "ci95": bootstrap_ci(d)}
            if html:  # a task is won when its similarity is higher; ties count half
                wins = [1.0 if x > 0 else 0.5 if x == 0 else 0.0 for x in d]
                paired[name].update(win_rate=sum(wins) / len(wins), win_rate_ci95=bootstrap_ci(wins),
                                    won=sum(x > 0 for x in d), tied=sum(x == 0 for x in d), lost=sum(x < 0 for x in d))
            if name in exact_task and base in exact_task:  # the similarity barely sees some design facts
                e = [exact_task[name][t] - exact_task[base][t] for t in tasks]
                paired[name].update(exact_design_diff=sum(e) / len(e), exact_design_ci95=bootstrap_ci(e))
    credit_file = Path(f"{args.credit}.credit.json")
    credit = json.loads(credit_file.read_text()) if args.credit and credit_file.exists() else {}
    if args.credit and not credit:
        print(f"{credit_file}: not found (credit.py writes it); no turn credit in the results", file=sys.stderr)
    res.update({k: v for k, v in credit.items()
                if k.startswith("credit_") or k in ("class_accuracy", "by_kind", "kind_order", "forms")})
    grade.print_comparison(res, BOOTSTRAP)
    for line in credit.get("lines", []):  # turn credit, as credit.py said it
        print(line)
    if args.select:  # max() keeps the first of equal values: the starting policy, then the least-trained snapshot
        by = "exact_design" if len(exact) == len(runs) else score  # procedural pages: success, as on code
        best = max(res["methods"], key=lambda n: res["methods"][n][by])
        res["selected"], res["selected_policy"], res["selected_by"] = best, res["methods"][best]["policy"], by
        print(f"selected by {by.replace('_', ' ')}: {best} ({res['selected_policy'] or 'no policy given'})")
    if args.summary:
        common.write_text(args.summary, json.dumps(res, indent=2))
    return res


GRADING = ("task_type", "released_semantics", "timeout", "clip_model")  # the settings a grade depends on


def graded_before(rows, args):
    """(rows, extra) from --output when it already grades exactly these trajectories with the same GRADING
    settings (a resumed run.sh), else None. Delete --output to grade again, e.g. after changing the grader."""
    settings = f"{args.output}.run_settings.json"
    if not (args.output and os.path.exists(args.output) and os.path.exists(settings)):
        return None
    try:
        before = json.load(open(settings))
        old = [r for _, r in common.read_jsonl(args.output)]
    except (ValueError, common.DataError):
        return None
    if any(before.get(k) != getattr(args, k) for k in GRADING) or len(old) != len(rows) or \
            any(any(o.get(k) != v for k, v in r.items()) for o, r in zip(old, rows)):
        return None
    extra = {"released_semantics": args.released_semantics}
    if args.task_type == "html":  # failures as grade_html counts them: each answer, and each task's target once
        if not old or any("target_rendered" not in r for r in old):
            return None  # graded before target_rendered was recorded
        extra = {"metric": old[0]["metric"], "render_failures": sum(not r["rendered"] for r in old)
                 + len({r["task_id"] for r in old if not r["target_rendered"]})}
    print(f"reusing {args.output}: it grades these {len(rows)} trajectories with the same settings "
          f"(delete it to grade again)")
    return old, extra


def main(args):
    if args.compare:
        return compare(args)
    common.refuse(args.task_type not in ("code", "html") and f"--task_type {args.task_type}: choose code or html",
                  args.k < 1 and "--k must be at least 1", args.timeout <= 0 and "--timeout must be positive",
                  args.task_type == "html" and args.released_semantics and "--released_semantics applies to code only",
                  args.reference and args.task_type != "html" and "--reference (win rate) applies to --task_type html",
                  args.reference and not os.path.exists(args.reference) and f"--reference {args.reference}: not found",
                  not args.input and "--input is required (or --compare NAME=GRADED,...)")
    common.check_writable(args.output, args.summary)  # before grading: a bad path loses no work
    rows = grade.load_trajectories(args.input, args.task_type)
    graded = graded_before(rows, args)
    if graded:
        rows, extra = graded
    elif args.task_type == "html":
        rows, extra = grade.grade_html_answers(rows, args.clip_model)
    else:
        rows = grade.grade_code_answers(rows, args.timeout, args.released_semantics, args.workers)
        extra = {"released_semantics": args.released_semantics}
    if args.output and not graded:
        common.write_jsonl(args.output, rows)
        common.save_run_settings(f"{args.output}.run_settings.json", args)
    s = {**grade.summarize(rows, args.k), **extra}
    if args.task_type == "html":
        s["win_rate"] = None
        if rows and all("exact_design" in r for r in rows):  # procedural pages: success = exact design
            s["exact_design"] = s["success_rate"]
        if args.reference:
            ref = [r for _, r in common.read_jsonl(args.reference)]
            if ref and ref[0].get("metric") != s["metric"]:
                sys.exit(f"{args.reference} was scored with {ref[0].get('metric')}, this run with {s['metric']}: "
                         f"not comparable")
            s["win_rate"] = grade.win_rate(rows, [dict(r, task_id=r.get("task_id") or colbench.task_id(r["task"]))
                                            for r in ref])
    grade.print_table(s, f"ColBench {'frontend' if args.task_type == 'html' else 'backend'}: {args.input}")
    if args.summary:
        common.write_text(args.summary, json.dumps(s, indent=2))
    return s


if __name__ == "__main__":
    common.run(main, Args, __doc__)
