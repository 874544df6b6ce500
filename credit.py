"""Turn-credit diagnostics: how well a critic ranks candidate turns, checked against ground truth.
A library of label_turns.py (which writes PAIRS.credit.json) and evaluate.py (which reports it).

On procedural tasks the scripted human's facts give every candidate turn a true class: on code
(colbench.turn_class) a question that reveals an unknown fact, or an answer that passes the tests, is
good; on pages (colbench.design_turn_class) a question or a draft that reveals an unknown design
fact, or an answer whose render matches every design fact. A critic is scored on every two
candidates of a state whose classes differ, beside the best state-blind order of turn kinds.
"""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import colbench
import common
import sandbox


class TrueClasses:
    """Every candidate turn's true class, grading answers against the ground truth's results (run once
    per task, in the sandbox); on procedural pages, from the design features of each page's render."""

    def __init__(self, max_turns):
        self.max_turns, self.gt_results, self.pool, self.features = max_turns, {}, None, {}

    def page_features(self, html):
        """render.design_features of a page's render (one headless browser, started on first use; cached)."""
        if html not in self.features:
            import render
            self.pool = self.pool or render.RenderPool(1)
            self.features[html] = render.design_features(self.pool.render(html)[0])
        return self.features[html]

    def close(self):
        if self.pool is not None:
            self.pool.close()

    def __call__(self, traj, turn, candidates):
        """Every candidate's true class (colbench.turn_class), or None where the task has no scripted facts."""
        task = traj["task"]
        if task.get("hidden_information") and "test_cases" not in task and colbench.design_of(task):  # a procedural page
            before = state_dialogue(traj, turn)
            return [colbench.design_turn_class(task, before, c, turn >= self.max_turns - 1, self.page_features)
                    for c in candidates]
        if "family" not in task or "test_cases" not in task:
            return None
        if task["task_id"] not in self.gt_results:
            self.gt_results[task["task_id"]] = sandbox.run_calls(task["ground_truth"], list(task["test_cases"].items()))
        grade = lambda code: sandbox.grade_code(task, code, gt_results=self.gt_results[task["task_id"]])["success"]
        before = state_dialogue(traj, turn)
        return [colbench.turn_class(task, before, c, turn >= self.max_turns - 1, grade) for c in candidates]


def state_dialogue(traj, turn):
    """The messages before agent turn `turn` (what the agent had seen)."""
    seen = 0
    for j, m in enumerate(traj["dialogue_history"]):
        if m["role"] == "assistant" and "input" in m:
            if seen == turn:
                return traj["dialogue_history"][:j]
            seen += 1
    return traj["dialogue_history"]


def credit_accuracy(states, name):
    """Turn-credit accuracy of one critic over labelled states: among every two candidates of a state
    whose ground-truth classes differ, the share where the critic gives the good one the higher
    advantage (ties count half). Returns (accuracy or None, number of such pairs)."""
    scores = [hit for *_, hit in class_pairs(states, name)]
    return (sum(scores) / len(scores) if scores else None), len(scores)


def class_pairs(states, name):
    """(state, good candidate's index, bad candidate's index, 1 / 0.5 / 0 as the critic `name` orders them;
    ties half) for every two candidates of a labelled state whose true classes differ."""
    for s in states:
        cls, adv = s.get("classes"), s.get("advantages_by_critic", {}).get(name)
        if not cls or adv is None:
            continue
        for i in range(len(cls)):
            for j in range(len(cls)):
                if cls[i] == "good" and cls[j] == "bad":
                    yield s, i, j, 1.0 if adv[i] > adv[j] else 0.5 if adv[i] == adv[j] else 0.0


def credit_by_kind(states, name):
    """credit_accuracy split by what the two candidates are, e.g. 'good answer > bad question' (an informed
    state: answering beats asking again): {split: [accuracy, pairs]}."""
    hits = {}
    for s, i, j, hit in class_pairs(states, name):
        kinds = [colbench.turn_kind(s["candidates"][k]) for k in (i, j)]
        h = hits.setdefault(f"good {kinds[0]} > bad {kinds[1]}", [0.0, 0])
        h[0] += hit
        h[1] += 1
    return {k: [round(h / n, 4), n] for k, (h, n) in sorted(hits.items())}


def kind_order(states):
    """The baseline a critic's turn-credit must beat: the best accuracy of a rule that looks only at what a
    turn is, one fixed order of kinds in every state (e.g. draft > question > answer; ties within a kind).
    Its accuracy says how much of the score a blanket preference earns; the rest needs the state.
    Returns {"order": "draft > question > answer", "accuracy": a} or None without class pairs."""
    labelled = [(s["classes"], [colbench.turn_kind(c) for c in s["candidates"]]) for s in states if s.get("classes")]
    best = None
    for order in itertools.permutations(sorted({k for _, kinds in labelled for k in kinds})):
        rank = {kind: -i for i, kind in enumerate(order)}
        ranked = [{"classes": classes, "advantages_by_critic": {"kinds": [rank[k] for k in kinds]}} for classes, kinds in labelled]
        acc = credit_accuracy(ranked, "kinds")[0]
        if acc is not None and (best is None or acc > best["accuracy"]):
            best = {"order": " > ".join(order), "accuracy": acc}
    return best


def kind_order_line(k):
    return f"best fixed order of turn kinds (no state): {k['order']} {k['accuracy']:.3f}" if k else ""


def accuracies(states, critics):
    """Every critic's turn-credit accuracy (and 'untrained', pi_ref: advantage 0 for every turn), its
    split by kind, and the state-blind kind order beside them."""
    out = {"credit_accuracy": {}, "class_pairs": {}}
    for name in [*critics, "untrained"]:
        out["credit_accuracy"][name], out["class_pairs"][name] = credit_accuracy(states, name)
    return {**out, "by_kind": {name: credit_by_kind(states, name) for name in critics}, "kind_order": kind_order(states)}


def accuracy_line(acc):
    return ", ".join(f"{k} {v:.3f}" if v is not None else f"{k} -" for k, v in acc.items())


def classes_by_state(states):
    """{(task_id, sample, turn): {candidate text: true class}} for the states that have classes."""
    return {(s["task_id"], s["sample"], s["turn"]): dict(zip(s["candidates"], s["classes"])) for s in states if s.get("classes")}


def dpo_pair_classes(states, pairs):
    """How the DPO pairs stand against the true classes: right (a good turn chosen over a bad one),
    wrong (bad over good), same_class (the pair says nothing the true classes could check)."""
    classes = classes_by_state(states)
    counts = {"right": 0, "wrong": 0, "same_class": 0}
    for p in pairs:
        c = classes.get((p["task_id"], p["sample"], p["turn"]))
        if c is not None:
            chosen, rejected = c[p["chosen"]], c[p["rejected"]]
            counts["same_class" if chosen == rejected else "right" if chosen == "good" else "wrong"] += 1
    return counts


def report(out_path, critics=None):
    """Turn-credit accuracy of every critic (names; default: all in the states file) on the labelled states of
    out_path (label_turns' PAIRS), printed and written to PAIRS.credit.json. 'untrained' is pi_ref itself as
    critic: its advantage is 0 for every turn."""
    states = [r for _, r in common.read_jsonl(Path(f"{out_path}.states.jsonl"))] if Path(f"{out_path}.states.jsonl").exists() else []
    for s in states:  # the untrained critic is pi_ref: log pi_ref - log pi_ref = 0 for every turn
        if "advantages_by_critic" in s:
            s["advantages_by_critic"]["untrained"] = [0.0] * len(s["candidates"])
    if critics is None:
        critics = list(dict.fromkeys(k for s in states for k in s.get("advantages_by_critic", {}) if k != "untrained"))
    report = {"states": len(states), "states_with_classes": sum("classes" in s for s in states), **accuracies(states, critics)}
    if report["states_with_classes"]:
        pairs = [r for _, r in common.read_jsonl(out_path)] if Path(out_path).exists() else []
        report["dpo_pairs"] = dpo_pair_classes(states, pairs)
        common.write_text(f"{out_path}.credit.json", json.dumps(report, indent=2))
        print("turn-credit accuracy (pairs of candidates with different true classes): " +
              accuracy_line(report["credit_accuracy"]), file=sys.stderr)
        print(kind_order_line(report["kind_order"]), file=sys.stderr)
        print("DPO pairs against the true classes: " + ", ".join(f"{k} {v}" for k, v in report["dpo_pairs"].items()),
              file=sys.stderr)
        for name, split in report["by_kind"].items():
            print(f"  {name}: " + ", ".join(f"{k} {a:.3f} ({n})" for k, (a, n) in split.items()), file=sys.stderr)
    return report
