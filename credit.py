"""Turn-credit diagnostics: how well a critic assigns credit to turns, checked against ground truth.
Apart from label_turns.py's sample -> score -> pair, which only calls in here.

On procedural code tasks the scripted human's facts give every candidate turn a true class
(colbench.turn_class: a question that reveals an unknown fact, or an answer that passes the tests,
is good). label_turns stores them in PAIRS.states.jsonl with every critic's advantages; here each
critic is scored on every two candidates of a state whose classes differ (turn-credit accuracy), and
the DPO pairs are counted as the true classes call them: right, wrong, or same class.

    python credit.py --pairs runs/default/pairs.jsonl   # report again, e.g. after `cat` of shard files

Deviations from the paper: none to speak of, as the paper has no such diagnostic; it measures a
critic only by the policy it trains. True classes need the procedural tasks' scripted facts, so
ColBench's own tasks get no credit report.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import colbench
import common
import sandbox


@dataclass
class Args:
    pairs: str = ""
    """label_turns.py's PAIRS JSONL (PAIRS.states.jsonl beside it); writes PAIRS.credit.json"""


class TrueClasses:
    """Every candidate turn's true class, grading answers against the ground truth's results (run once
    per task, in the sandbox)."""

    def __init__(self, max_turns):
        self.max_turns, self.gt_results = max_turns, {}

    def __call__(self, traj, turn, candidates):
        """Every candidate's true class (colbench.turn_class), or None where the task has no scripted facts."""
        task = traj["task"]
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
    hits, n = 0.0, 0
    for s in states:
        cls, adv = s.get("classes"), s.get("advantages_by_critic", {}).get(name)
        if not cls or adv is None:
            continue
        for i in range(len(cls)):
            for j in range(len(cls)):
                if cls[i] == "good" and cls[j] == "bad":
                    n += 1
                    hits += 1.0 if adv[i] > adv[j] else 0.5 if adv[i] == adv[j] else 0.0
    return (hits / n if n else None), n


def dpo_pair_classes(states, pairs):
    """How the DPO pairs stand against the true classes: right (a good turn chosen over a bad one),
    wrong (bad over good), same_class (the pair says nothing the true classes could check)."""
    classes = {(s["task_id"], s["sample"], s["turn"]): dict(zip(s["candidates"], s["classes"]))
               for s in states if s.get("classes")}
    counts = {"right": 0, "wrong": 0, "same_class": 0}
    for p in pairs:
        c = classes.get((p["task_id"], p["sample"], p["turn"]))
        if c is not None:
            chosen, rejected = c[p["chosen"]], c[p["rejected"]]
            counts["same_class" if chosen == rejected else "right" if chosen == "good" else "wrong"] += 1
    return counts


def report(out_path, critics=None):
    """Turn-credit accuracy of every critic (names; default: all in the states file) on the labelled
    states of out_path, printed and written to PAIRS.credit.json. 'untrained' is pi_ref itself as
    critic: its advantage is 0 for every turn."""
    states = [r for _, r in common.read_jsonl(Path(f"{out_path}.states.jsonl"))] if Path(f"{out_path}.states.jsonl").exists() else []
    report = {"states": len(states), "states_with_classes": sum("classes" in s for s in states), "credit_accuracy": {},
              "class_pairs": {}}
    for s in states:  # the untrained critic is pi_ref: log pi_ref - log pi_ref = 0 for every turn
        if "advantages_by_critic" in s:
            s["advantages_by_critic"]["untrained"] = [0.0] * len(s["candidates"])
    if critics is None:
        critics = list(dict.fromkeys(k for s in states for k in s.get("advantages_by_critic", {}) if k != "untrained"))
    for name in [*critics, "untrained"]:
        report["credit_accuracy"][name], report["class_pairs"][name] = credit_accuracy(states, name)
    if report["states_with_classes"]:
        pairs = [r for _, r in common.read_jsonl(out_path)] if Path(out_path).exists() else []
        report["dpo_pairs"] = dpo_pair_classes(states, pairs)
        common.write_text(f"{out_path}.credit.json", json.dumps(report, indent=2))
        print("turn-credit accuracy (pairs of candidates with different true classes): " +
              ", ".join(f"{k} {v:.3f}" if v is not None else f"{k} -" for k, v in report["credit_accuracy"].items()),
              file=sys.stderr)
        print("DPO pairs against the true classes: " + ", ".join(f"{k} {v}" for k, v in report["dpo_pairs"].items()),
              file=sys.stderr)
    return report


if __name__ == "__main__":
    args = common.parse_args(Args, __doc__)
    common.refuse(not Path(f"{args.pairs}.states.jsonl").exists() and f"--pairs {args.pairs}: no {args.pairs}.states.jsonl "
                  f"beside it (label_turns.py writes one; merge shard files first)")
    try:
        if not report(args.pairs)["states_with_classes"]:
            sys.exit(f"{args.pairs}.states.jsonl has no true classes (only procedural code tasks have them)")
    except common.DataError as e:
        sys.exit(f"error: {e}")
