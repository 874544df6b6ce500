"""ColBench's grading of whole dialogues, many at once: code in the sandbox (each task's ground truth run once),
pages rendered and compared (colbench.render); and the benchmark's table (success, tests passed, best of k).
One answer alone: colbench.sandbox.grade_code(task, answer).

    from colbench import grade
    grade.grade_code_answers(rows)      # rows: {"task", "task_id", "answer"}; adds reward, success, verdicts, ...
    grade.grade_html_answers(rows)      # adds reward (similarity), metric, rendered; procedural pages: success
    grade.print_table(grade.summarize(rows, k=1))
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

import colbench
from colbench import render, sandbox
from common import DataError, read_jsonl


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
    """similarity of the rendered final answer and the rendered target (its metric named), the reward of a
    ColBench page. On procedural pages with design facts the reward is the share of the design facts the answer's
    render gets right (render.design_features, read from pixels), as a code task's is its tests, and success =
    exact_design = every fact right."""
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
        r.update(reward=float(s), similarity=float(s), metric=sim.metric, rendered=ok,
                 target_rendered=targets[r["task_id"]][1])
        design = colbench.design_of(r["task"]) if r["task"].get("hidden_information") else {}
        if design:
            wrong = colbench.design_mismatches(design, render.design_features(img)) if r["answer"] else list(design)
            r.update(reward=1 - len(wrong) / len(design), success=not wrong, exact_design=not wrong)
    return rows, {"metric": sim.metric, "render_failures": failures}


def win_rate(rows, reference_rows):
    """Per task (mean over samples): this run's similarity beats the reference's; ties count half."""
    mean = lambda rs: {t: sum(x) / len(x) for t, x in _by_task(rs).items()}
    ours, ref = mean(rows), mean(reference_rows)
    common_tasks = sorted(set(ours) & set(ref))
    if not common_tasks:
        raise DataError("--reference shares no task with --input")
    return sum(1.0 if ours[t] > ref[t] else 0.5 if ours[t] == ref[t] else 0.0 for t in common_tasks) / len(common_tasks)


def similarity(r):
    """A graded page's similarity to its target (files graded before the field was kept: their reward)."""
    return r.get("similarity", r["reward"])


def _by_task(rows):
    out = defaultdict(list)
    for r in rows:
        out[r["task_id"]].append(similarity(r))
    return out


def load_trajectories(path, task_type="code"):
    """Trajectories in the released schema, all checked before any grading; task_id and sample
    derived when absent."""
    rows, counts = [], defaultdict(int)
    for line, r in read_jsonl(path):
        colbench.validate_trajectory(r, f"{path}:{line}", task_type)
        if "answer" not in r:
            raise DataError(f"{path}:{line}: missing field 'answer' (a trajectory needs task, dialogue_history "
                                   f"and answer)")
        r["task_id"] = r.get("task_id") or colbench.task_id(r["task"])
        if "sample" not in r:
            r["sample"] = counts[r["task_id"]]
        counts[r["task_id"]] += 1
        rows.append(r)
    return rows


def answered(r):
    """the dialogue ended with an answer (older files without `finish`: the marker appears in it)"""
    marked = colbench.ANSWER_MARKER in json.dumps(r["dialogue_history"])
    return r.get("finish", "answered" if marked else "") == "answered"


def summarize(rows, k=1):
    by_task = defaultdict(list)
    for r in rows:
        by_task[r["task_id"]].append(r)
    mean = lambda xs: sum(xs) / max(len(xs), 1)
    s = {"num_trajectories": len(rows), "num_tasks": len(by_task),
         "success_rate": mean([r.get("success", False) for r in rows]),
         "tests_passed": mean([r["reward"] for r in rows]),
         "mean_turns": mean([colbench.num_agent_turns(r) for r in rows]),
         "answered_rate": mean([answered(r) for r in rows]),
         "errors": sum(r.get("finish") == "error" for r in rows),
         "timeouts": sum(r.get("timeouts", 0) > 0 for r in rows), "k": k,
         "verdicts": dict(Counter(v for r in rows for v in r.get("verdicts", {}).values()))}
    firstk = [sorted(v, key=lambda r: r["sample"])[:k] for v in by_task.values()]
    s["best_of_k_success"] = mean([any(r.get("success", False) for r in v) for v in firstk])
    s["best_of_k_tests"] = mean([max(r["reward"] for r in v) for v in firstk])
    if rows and "metric" in rows[0]:  # pages: their similarity, beside the reward (procedural: the facts right)
        s["similarity"] = mean([similarity(r) for r in rows])
        s["best_of_k_similarity"] = mean([max(map(similarity, v)) for v in firstk])
    return s


def print_table(s, title=""):
    lines = [("trajectories", s["num_trajectories"]), ("tasks", s["num_tasks"])]
    if "similarity" in s:
        lines += [(f"similarity ({s['metric']})", f"{100 * s['similarity']:.1f}%")]
        if s["k"] > 1:
            lines += [(f"best-of-{s['k']} similarity", f"{100 * s['best_of_k_similarity']:.1f}%")]
        if s.get("exact_design") is not None:
            lines += [("exact design (every design fact right)", f"{100 * s['exact_design']:.1f}%"),
                      ("% design facts right (the reward)", f"{100 * s['tests_passed']:.1f}%")]
            if s["k"] > 1:
                lines += [(f"best-of-{s['k']} exact design", f"{100 * s['best_of_k_success']:.1f}%")]
        if s.get("win_rate") is not None:
            lines += [("win rate vs reference", f"{100 * s['win_rate']:.1f}%")]
        lines += [("pages that failed to render", s["render_failures"])]
    else:
        lines += [("success rate", f"{100 * s['success_rate']:.1f}%"),
                  ("% tests passed", f"{100 * s['tests_passed']:.1f}%")]
    if s["k"] > 1 and "similarity" not in s:
        lines += [(f"best-of-{s['k']} success", f"{100 * s['best_of_k_success']:.1f}%"),
                  (f"best-of-{s['k']} tests", f"{100 * s['best_of_k_tests']:.1f}%")]
    lines += [("mean agent turns", f"{s['mean_turns']:.2f}"),
              ("answered with marker", f"{100 * s['answered_rate']:.1f}%"),
              ("trajectories with a timed-out test", s["timeouts"]), ("rollout errors", s["errors"])]
    if s.get("verdicts"):
        verdicts = ", ".join(f"{v} {s['verdicts'][v]}" for v in sandbox.VERDICTS if v in s["verdicts"])
        lines += [("test verdicts", verdicts)]
    print(f"\n{title or 'ColBench'}")
    for name, v in lines:
        print(f"  {name:<44} {v}")


def print_comparison(res, resamples):
    """The comparison table of evaluate.py --compare's results (methods with 95% intervals, paired differences to
    the first method; pages: win rates and exact designs), then how long each method's dialogues ran and, on
    procedural tasks, where they ended."""
    html, metric = "metric" in res, res.get("metric")
    score, base = ("similarity" if html else "success"), next(iter(res["methods"]))
    paired = res[f"paired_vs_{base}"]
    length, outcomes = res["methods"], {name: m["outcomes"] for name, m in res["methods"].items() if "outcomes" in m}
    last = "exact design" if html else "tests passed"
    print(f"{'method':<16}{score:>11}{'95% interval':>18}{'vs ' + base:>14}{'95% interval':>18}{last:>14}"
          + (f"{'win rate':>10}{'95% interval':>16}" if html else ""))
    for name, m in res["methods"].items():
        p = paired.get(name)
        ci = f"[{100 * m['ci95'][0]:.1f}, {100 * m['ci95'][1]:.1f}]"
        diff = f"{100 * p['diff']:+.1f}" if p else "-"
        diff_ci = f"[{100 * p['ci95'][0]:+.1f}, {100 * p['ci95'][1]:+.1f}]" if p else ""
        tail = m.get("exact_design" if html else "tests_passed")
        line = f"{name:<16}{100 * m[score]:>10.1f}%{ci:>18}{diff:>14}{diff_ci:>18}" + \
            (f"{100 * tail:>13.1f}%" if tail is not None else f"{'-':>14}")
        if html and p:
            wci = p["win_rate_ci95"]
            line += f"{100 * p['win_rate']:>9.1f}%" + f"[{100 * wci[0]:.1f}, {100 * wci[1]:.1f}]".rjust(16)
        elif html:
            line += f"{'-':>10}"
        print(line)
    print(f"({res['num_test_tasks']} tasks; {'similarity: ' + metric + '; ' if html else ''}95% intervals: bootstrap "
          f"over tasks, {resamples} resamples)")
    for name, p in paired.items():
        if "won" in p:
            print(f"{name} vs {base}: won {p['won']}, tied {p['tied']}, lost {p['lost']} tasks")
        if "exact_design_diff" in p:
            print(f"exact design, {name} vs {base}: {100 * p['exact_design_diff']:+.1f} "
                  f"[{100 * p['exact_design_ci95'][0]:+.1f}, {100 * p['exact_design_ci95'][1]:+.1f}] (paired)")
    # an update that shortens the dialogues answers sooner, with fewer facts heard
    print("agent turns (mean), answered: " + ", ".join(f"{name} {v['mean_turns']:.2f}, "
                                                      f"{100 * v['answered_rate']:.0f}%" for name, v in length.items()))
    if html:  # an update that asks until its turns run out loses such pages whole
        print("dialogues with no page to grade: " + ", ".join(f"{name} {v['no_page']}" for name, v in length.items()))
    if outcomes:
        print("where the dialogues ended: " + " / ".join(colbench.OUTCOMES))
        for name, o in outcomes.items():
            print(f"  {name:<16}" + " / ".join(str(o.get(k, 0)) for k in colbench.OUTCOMES))
