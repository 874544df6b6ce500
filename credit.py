"""Turn-credit diagnostics: how well a critic assigns credit to turns, checked against ground truth.
Apart from label_turns.py's sample -> score -> pair, which only calls in here.

On procedural tasks the scripted human's facts give every candidate turn a true class: on code
(colbench.turn_class) a question that reveals an unknown fact, or an answer that passes the tests,
is good; on frontend pages (colbench.design_turn_class) a question or a shown draft that reveals an
unknown design fact, or an answer whose render matches every design fact. label_turns stores them in
PAIRS.states.jsonl with every critic's advantages; here each critic is scored on every two candidates
of a state whose classes differ (turn-credit accuracy), and the DPO pairs are counted as the true
classes call them: right, wrong, or same class. Beside the critics stands the best fixed order of
turn kinds (say draft > question > answer, in every state): what a blanket preference earns without
reading the state, the baseline a critic's accuracy should clear.

    python credit.py --pairs runs/default/pairs.jsonl   # report again, e.g. after `cat` of shard files
    python credit.py --pairs runs/default/pairs.jsonl --trajectories runs/default/train_graded.jsonl --critics mine=DIR

With --critics, each critic (a train_critic.py output, e.g. of an edited critic variant) scores the
candidates already in the states file, so variants are compared on identical turns without sampling
again; the accuracies go to PAIRS.credit_rescored.json, the states with the new advantages to
PAIRS.states_rescored.jsonl, and the states file is left as it is.

Deviations from the paper: none to speak of, as the paper has no such diagnostic; it measures a
critic only by the policy it trains. True classes need the procedural tasks' scripted facts, so
ColBench's own tasks get no credit report.
"""
from __future__ import annotations

import itertools
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
    critics: str = ""
    """NAME=DIR,...: critics that score the stored candidates anew (needs --trajectories; NAME=DIR+DIR: an ensemble)"""
    trajectories: str = ""
    """with --critics: the graded trajectories label_turns.py read (the states' prompts and tasks)"""
    max_len: int = 16384
    """with --critics: longest prompt + candidate, as label_turns.py's --max_len"""
    max_batch_tokens: int = 65536
    """with --critics: scoring sub-batches, as label_turns.py's --max_batch_tokens"""


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
        cls, adv = s.get("classes"), rank_keys(s, name)
        if not cls or adv is None:
            continue
        for i in range(len(cls)):
            for j in range(len(cls)):
                if cls[i] == "good" and cls[j] == "bad":
                    yield s, i, j, 1.0 if adv[i] > adv[j] else 0.5 if adv[i] == adv[j] else 0.0


def rank_keys(s, name):
    """How labelling ranked a state's candidates by critic `name`, one comparable key each: (advantage,), or with
    first-line decisions (label_turns --cross_kind decision) (decision, advantage); None without that critic."""
    adv = s.get("advantages_by_critic", {}).get(name)
    dec = s.get("decisions_by_critic", {}).get(name)
    if adv is None:
        return None
    return [(d, a) for d, a in zip(dec, adv)] if dec is not None else [(a,) for a in adv]


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


def accuracies(states, critics, members=()):
    """Every critic's turn-credit accuracy (and 'untrained', pi_ref: advantage 0 for every turn), its
    split by kind, and the state-blind kind order beside them: the fields both reports share. members:
    ensembles' members (ensemble_members), whose accuracy is listed after the critics', without a split."""
    out = {"credit_accuracy": {}, "class_pairs": {}}
    for name in [*critics, *members, "untrained"]:
        out["credit_accuracy"][name], out["class_pairs"][name] = credit_accuracy(states, name)
    return {**out, "by_kind": {name: credit_by_kind(states, name) for name in critics}, "kind_order": kind_order(states),
            "answer_over_asking": {name: answer_over_asking(states, name) for name in critics}}


def answer_over_asking(states, name):
    """Whether a critic reads the state or leans to a kind of turn: over every answer and question-or-draft
    candidate of a state, the share where the critic ranks the answer higher (ties half), in the states where
    the human had already told every hidden fact (asking again reveals nothing: the answer is the better turn
    whenever the classes differ) and in the others. {"told_all": [share, n], "not_yet": [share, n]}; a
    critic that reads the state ranks answers far higher in the first; one that leans, alike in both."""
    out = {}
    for s in states:
        adv = rank_keys(s, name)
        if adv is None or "told_all" not in s:
            continue
        kinds = [colbench.turn_kind(c) for c in s["candidates"]]
        h = out.setdefault("told_all" if s["told_all"] else "not_yet", [0.0, 0])
        for i, j in itertools.product(range(len(kinds)), repeat=2):
            if kinds[i] == "answer" and kinds[j] != "answer":
                h[0] += 1.0 if adv[i] > adv[j] else 0.5 if adv[i] == adv[j] else 0.0
                h[1] += 1
    return {k: [round(h / n, 4), n] for k, (h, n) in sorted(out.items()) if n}


def ensemble_members(groups):
    """The members of every ensemble in {name: [members]} (label_turns.critic_members), in order."""
    return [m for members in groups.values() if len(members) > 1 for m in members]


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


def dpo_pair_kinds(states, pairs):
    """What the DPO pairs teach, by what the chosen and the rejected turn are, with their true class where the
    state has classes: {"bad answer > bad question": n, ...}, commonest first. Same-class pairs are judged by
    the critic alone, and their kinds say which way they push: many "bad answer > bad question" pairs (a wrong
    answer over a wasted question) teach answering sooner, and the update shortens dialogues."""
    classes = classes_by_state(states)
    counts = {}
    for p in pairs:
        c = classes.get((p["task_id"], p["sample"], p["turn"]), {})
        key = " > ".join(" ".join(filter(None, [c.get(t), colbench.turn_kind(t)])) for t in (p["chosen"], p["rejected"]))
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def answer_balance(kinds):
    """From dpo_pair_kinds: (pairs that choose an answer over a question or draft, pairs that reject one for
    them). The first above the second pushes the policy to answer sooner."""
    sooner = later = 0
    for key, n in kinds.items():
        chosen, rejected = (side.split()[-1] for side in key.split(" > "))
        sooner += n * (chosen == "answer" and rejected != "answer")
        later += n * (rejected == "answer" and chosen != "answer")
    return sooner, later


def report(out_path, critics=None, members=()):
    """Turn-credit accuracy of every critic (names; default: all in the states file) and ensemble member
    (accuracies) on the labelled states of out_path, printed and written to PAIRS.credit.json. 'untrained'
    is pi_ref itself as critic: its advantage is 0 for every turn."""
    states = [r for _, r in common.read_jsonl(Path(f"{out_path}.states.jsonl"))] if Path(f"{out_path}.states.jsonl").exists() else []
    for s in states:  # the untrained critic is pi_ref: log pi_ref - log pi_ref = 0 for every turn
        if "advantages_by_critic" in s:
            s["advantages_by_critic"]["untrained"] = [0.0] * len(s["candidates"])
    if critics is None:
        critics = list(dict.fromkeys(k for s in states for k in s.get("advantages_by_critic", {}) if k != "untrained"))
    report = {"states": len(states), "states_with_classes": sum("classes" in s for s in states),
              **accuracies(states, critics, members)}
    if report["states_with_classes"]:
        pairs = [r for _, r in common.read_jsonl(out_path)] if Path(out_path).exists() else []
        report["dpo_pairs"] = dpo_pair_classes(states, pairs)
        report["dpo_pair_kinds"] = dpo_pair_kinds(states, pairs)
        common.write_text(f"{out_path}.credit.json", json.dumps(report, indent=2))
        print("turn-credit accuracy (pairs of candidates with different true classes): " +
              accuracy_line(report["credit_accuracy"]), file=sys.stderr)
        print(kind_order_line(report["kind_order"]), file=sys.stderr)
        print("DPO pairs against the true classes: " + ", ".join(f"{k} {v}" for k, v in report["dpo_pairs"].items()),
              file=sys.stderr)
        sooner, later = answer_balance(report["dpo_pair_kinds"])
        print(f"DPO pairs by kind (chosen > rejected): an answer over a question or draft {sooner}, the reverse {later}; " +
              ", ".join(f"{k} {n}" for k, n in list(report["dpo_pair_kinds"].items())[:6]), file=sys.stderr)
        for name, split in report["answer_over_asking"].items():
            if split:
                print(f"  {name} ranks an answer above a question or draft: " +
                      ", ".join(f"{k.replace('_', ' ')} {a:.2f} ({n})" for k, (a, n) in split.items()) +
                      " (told all: the human had said every hidden fact, so the answer is the better turn)", file=sys.stderr)
        for name, split in report["by_kind"].items():
            print(f"  {name}: " + ", ".join(f"{k} {a:.3f} ({n})" for k, (a, n) in split.items()), file=sys.stderr)
    return report


def rescore(pairs_path, trajectories, critic_dirs, max_len=16384, max_batch_tokens=65536):
    """Turn-credit accuracy of critics (name -> train_critic.py output) on the candidates stored in
    PAIRS.states.jsonl, scored anew as label_turns.py scores them; written to PAIRS.credit_rescored.json."""
    import label_turns  # the scoring itself (imports this module; only needed here)
    import models
    states = [r for _, r in common.read_jsonl(Path(f"{pairs_path}.states.jsonl")) if r.get("classes")]
    trajs = {(t["task_id"], t.get("sample", 0)): t for t in colbench.load_graded(trajectories)}
    members, groups = label_turns.critic_members(critic_dirs)
    settings, ref_name = label_turns.load_critics(members)
    scorer = label_turns.Scorer.load(members, settings, ref_name, models.local_device(), max_len, 0, max_batch_tokens,
                                     groups=groups)
    for s in common.tqdm_if(states, True, "states"):
        traj = trajs.get((s["task_id"], s["sample"]))
        if traj is None:
            raise common.DataError(f"{pairs_path}.states.jsonl: task {s['task_id']} sample {s['sample']} is not in "
                                   f"{trajectories} (pass the trajectories label_turns.py read)")
        scored = scorer.advantages(traj["task"], colbench.agent_turns(traj)[s["turn"]][0], s["candidates"],
                                   decisions="decisions" in s)  # ranked as labelling ranked them
        s["advantages_by_critic"], s["decisions_by_critic"] = scored if "decisions" in s else (scored, {})
        s["advantages_by_critic"]["untrained"] = [0.0] * len(s["candidates"])
    out = {"states": len(states), "critics": critic_dirs, **accuracies(states, list(groups), ensemble_members(groups))}
    common.write_text(f"{pairs_path}.credit_rescored.json", json.dumps(out, indent=2))
    common.write_text(f"{pairs_path}.states_rescored.jsonl", "".join(json.dumps(s) + "\n" for s in states))
    print("turn-credit accuracy on the stored candidates: " + accuracy_line(out["credit_accuracy"]))
    print(kind_order_line(out["kind_order"]))
    return out


if __name__ == "__main__":
    args = common.parse_args(Args, __doc__)
    if args.critics:
        common.refuse(not args.trajectories and "--critics needs --trajectories (the graded trajectories label_turns.py read)",
                      any("=" not in kv for kv in args.critics.split(",") if kv)
                      and f"--critics {args.critics}: expected NAME=DIR,NAME=DIR",
                      not Path(f"{args.pairs}.states.jsonl").exists() and f"--pairs {args.pairs}: no {args.pairs}.states.jsonl")
        try:
            rescore(args.pairs, args.trajectories, dict(kv.split("=", 1) for kv in args.critics.split(",") if kv), args.max_len,
                    args.max_batch_tokens)
        except common.DataError as e:
            sys.exit(f"error: {e}")
        sys.exit(0)
    common.refuse(not Path(f"{args.pairs}.states.jsonl").exists() and f"--pairs {args.pairs}: no {args.pairs}.states.jsonl "
                  f"beside it (label_turns.py writes one; merge shard files first)")
    try:
        if not report(args.pairs)["states_with_classes"]:
            sys.exit(f"{args.pairs}.states.jsonl has no true classes (only procedural code tasks and pages have them)")
    except common.DataError as e:
        sys.exit(f"error: {e}")
