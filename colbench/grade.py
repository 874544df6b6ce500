"""Grading whole dialogues' answers, many at once: code in the sandbox (each task's ground truth run once),
pages rendered and compared (colbench.render). One answer alone: colbench.sandbox.grade_code(task, answer).

    from colbench import grade
    grade.grade_code_answers(rows)      # rows: {"task", "task_id", "answer"}; adds reward, success, verdicts, ...
    grade.grade_html_answers(rows)      # adds reward (similarity), metric, rendered; procedural pages: success
"""
from __future__ import annotations

import os
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

import colbench
from colbench import render, sandbox
from common import DataError


def grade_code_answers(rows, timeout=10.0, released=False, workers=0):
    """Adds reward/success/... to each row in place (answers of one task share one ground-truth run)."""
    tasks = {r["task_id"]: r["task"] for r in rows}
    workers = workers or 2 * (os.cpu_count() or 1)
    calls = lambda t: list(t["test_cases"].items())
    with ThreadPoolExecutor(workers) as pool:
        run_gt = lambda t: sandbox.run_calls(t["ground_truth"], calls(t), timeout, released,
                                             trusted=True)
        gt = dict(zip(tasks, tqdm(pool.map(run_gt, tasks.values()), total=len(tasks), desc="ground truths")))
        grade = lambda r: sandbox.grade_code(r["task"], r["answer"], timeout, released,
                                             gt[r["task_id"]])
        grades = list(tqdm(pool.map(grade, rows), total=len(rows), desc="answers"))
    for r, g in zip(rows, grades):
        r.update(reward=g["reward"], success=g["success"], tests_passed=g["passed"], tests_total=g["total"],
                 timeouts=g["timeouts"], verdicts=g["verdicts"])
    infra = sum(v == "infrastructure" for r in rows for v in r["verdicts"].values())
    if infra:
        print(f"WARNING: {infra} tests could not be judged (sandbox or ground-truth failure: 'infrastructure' "
              f"verdicts)", file=sys.stderr)
    return rows


def grade_html_answers(rows, clip_model="", render_workers=2):
    """reward = similarity of the rendered final answer and the rendered target (its metric named). On
    procedural pages with design facts also success = exact_design: the answer's render matches every
    design fact (render.design_features, read from pixels)."""
    sim = render.ImageSimilarity(clip_model)
    tasks = {r["task_id"]: r["task"]["ground_truth"] for r in rows}
    with render.RenderPool(render_workers) as pool, ThreadPoolExecutor(render_workers) as threads:
        renders = threads.map(pool.render_kept, tasks.values())
        targets = dict(zip(tasks, tqdm(renders, total=len(tasks), desc="target pages")))
        renders = threads.map(pool.render, [r["answer"] or "" for r in rows])
        answers = list(tqdm(renders, total=len(rows), desc="answer pages"))
        failures = pool.failures
    scores = sim([img for img, _ in answers], [targets[r["task_id"]][0] for r in rows])
    for r, s, (img, ok) in zip(rows, scores, answers):
        r.update(reward=float(s), metric=sim.metric, rendered=ok, target_rendered=targets[r["task_id"]][1])
        design = colbench.design_of(r["task"]) if r["task"].get("hidden_information") else {}
        if design:
            features = render.design_features(img)
            wrong = colbench.design_mismatches(design, features) if r["answer"] else list(design)
            r["success"] = r["exact_design"] = not wrong
    return rows, {"metric": sim.metric, "render_failures": failures}


def win_rate(rows, reference_rows):
    """Per task (mean over samples): this run's similarity beats the reference's; ties count half."""
    mean = lambda rs: {t: sum(x) / len(x) for t, x in _by_task(rs).items()}
    ours, ref = mean(rows), mean(reference_rows)
    common_tasks = sorted(set(ours) & set(ref))
    if not common_tasks:
        raise DataError("--reference shares no task with --input")
    return sum(1.0 if ours[t] > ref[t] else 0.5 if ours[t] == ref[t] else 0.0 for t in common_tasks) / len(common_tasks)


def _by_task(rows):
    out = defaultdict(list)
    for r in rows:
        out[r["task_id"]].append(r["reward"])
    return out
