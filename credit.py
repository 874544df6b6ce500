"""Turn credit: how well a critic ranks candidate turns, checked against what the reward decides.

**credit_accuracy** (the metric): the share of the pairs of candidate turns whose order the reward decides that a
critic orders the same way (ties half), with a 95% interval (the states resampled), by kind of pair. Two kinds of
decided pairs: in every labelled state of a code task, two answers whose rewards differ (an answer ends the
dialogue, so its reward, the share of tests passed, is its outcome: exact, at the cost of grading); and on a fixed
sample of labelled states, every candidate's value under the policy that sampled it, by Monte Carlo: an answer graded
once, any other turn continued --continuations (16) times by that policy with the human (rollout.py --prefixes), its
value the mean reward (the share of tests or of design facts right; ColBench pages: the similarity), and only pairs
whose values differ significantly count. Beside it: the values' split-half agreement (two halves of the
continuations; the ceiling) and the best state-blind order of turn kinds on the same pairs (what a blanket preference
earns).

    python credit.py --pairs RUN/pairs.jsonl --trajectories RUN/train_graded.jsonl --max_turns 5
    python rollout.py --prefixes RUN/pairs.jsonl.mc.jsonl --output RUN/pairs.jsonl.mc_rollouts.jsonl ...
    python evaluate.py --input RUN/pairs.jsonl.mc_rollouts.jsonl --output RUN/pairs.jsonl.mc_graded.jsonl
    python credit.py --pairs RUN/pairs.jsonl --trajectories RUN/train_graded.jsonl --max_turns 5   # again: the report

A stage that no other imports. It reads label_turns.py's PAIRS.states.jsonl (every candidate and its advantage
under every critic) and the trajectories, writes every candidate's true class to PAIRS.classes.jsonl (once; a
rerun reuses them), the dialogues to continue to PAIRS.mc.jsonl (--states > 0, once), and the report to
PAIRS.credit.json, with the Monte-Carlo values once PAIRS.mc_graded.jsonl exists. evaluate.py --credit and view.py
read those files. (run.sh runs it after labelling, and again after the continuations are graded.)

A diagnostic beside it, on procedural tasks, by kind of pair: the scripted human's facts give every
candidate a true class (code: turn_class, a question that reveals an unknown fact or an
answer that passes the tests is good; pages: design_turn_class), and **class_accuracy** scores
a critic on every two candidates of a state whose classes differ, whether or not the reward orders them.
"""
from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import colbench
import common
from colbench import sandbox


class TrueClasses:
    """Every candidate turn's true class, grading answers against the ground truth's results (run once
    per task, in the sandbox); on procedural pages, from the design features of each page's render."""

    def __init__(self, max_turns):
        self.max_turns, self.gt_results, self.pool, self.features, self.graded = max_turns, {}, None, {}, {}

    def grade(self, task, code):
        """sandbox.grade_code of code on a code task (the ground truth run once a task; each code once)."""
        if task["task_id"] not in self.gt_results:
            self.gt_results[task["task_id"]] = sandbox.run_calls(task["ground_truth"], list(task["test_cases"].items()))
        key = (task["task_id"], code)
        if key not in self.graded:
            self.graded[key] = sandbox.grade_code(task, code, gt_results=self.gt_results[task["task_id"]])
        return self.graded[key]

    def grades(self, traj, turn, candidates):
        """[[index, reward]] for the first of each distinct answer among a code task's candidates (the reward: the
        share of tests passed): an answer ends the dialogue, so its reward is its outcome, and orders two answers."""
        task, first = traj["task"], {}
        if "test_cases" not in task:
            return []
        for i, c in enumerate(candidates):
            if is_answer(c, turn, self.max_turns):
                first.setdefault(c, i)
        return [[i, self.grade(task, colbench.extract_answer(c))["reward"]] for c, i in first.items()]

    def page_features(self, html):
        """render.design_features of a page's render (one headless browser, started on first use; cached)."""
        if html not in self.features:
            from colbench import render
            self.pool = self.pool or render.RenderPool(1)
            self.features[html] = render.design_features(self.pool.render(html)[0])
        return self.features[html]

    def close(self):
        if self.pool is not None:
            self.pool.close()

    def __call__(self, traj, turn, candidates):
        """Every candidate's true class (turn_class), or None where the task has no scripted facts."""
        task = traj["task"]
        if task.get("hidden_information") and "test_cases" not in task and colbench.design_of(task):  # a page
            before = state_dialogue(traj, turn)
            return [design_turn_class(task, before, c, turn >= self.max_turns - 1, self.page_features)
                    for c in candidates]
        if "family" not in task or "test_cases" not in task:
            return None
        before = state_dialogue(traj, turn)
        grade = lambda code: self.grade(task, code)["success"]
        return [turn_class(task, before, c, turn >= self.max_turns - 1, grade) for c in candidates]


def turn_class(task, dialogue, turn, last_turn=False, grade=None):
    """Ground-truth credit of one candidate agent turn after `dialogue` (procedural code tasks with the
    scripted human): 'good' for a question whose scripted reply reveals a fact not yet revealed, or
    an answer whose code passes every test; 'bad' for a failing answer or a question that reveals
    nothing new. A turn is an answer when it has the marker or is the dialogue's last allowed turn.
    grade(code) -> success (default: grade_code in the sandbox)."""
    if colbench.ANSWER_MARKER in turn or last_turn:
        answer = colbench.extract_answer(turn)
        ok = grade(answer) if grade else sandbox.grade_code(task, answer)["success"]
        return "good" if ok else "bad"
    known = colbench.revealed_facts(task, dialogue)
    reply = colbench.scripted_reply(task["hidden_information"], turn)
    new = {f for f in colbench.hidden_facts(task) if f in reply} - known
    return "good" if new else "bad"


def design_turn_class(task, dialogue, turn, last_turn, features_of):
    """Ground-truth credit of a candidate turn on a procedural page (features_of(html) -> the render's
    design features): an answer is good when its page matches every design fact; a question or a shown
    draft is good when the human's reply reveals a hidden fact not yet revealed."""
    page = colbench.extract_html(turn.split(colbench.ANSWER_MARKER, 1)[-1])
    if colbench.ANSWER_MARKER in turn or last_turn:
        return "good" if page and not colbench.design_mismatches(colbench.design_of(task), features_of(page)) else "bad"
    hidden = task["hidden_information"]
    reply = (colbench.draft_reply(hidden, features_of(page), colbench.design_in(task["problem_description"])) if page
             else colbench.scripted_reply(hidden, turn))
    new = {f for f in colbench.hidden_facts(task) if f in reply} - colbench.revealed_facts(task, dialogue)
    return "good" if new else "bad"


def state_dialogue(traj, turn):
    """The messages before agent turn `turn` (what the agent had seen)."""
    seen = 0
    for j, m in enumerate(traj["dialogue_history"]):
        if m["role"] == "assistant" and "input" in m:
            if seen == turn:
                return traj["dialogue_history"][:j]
            seen += 1
    return traj["dialogue_history"]


def class_accuracy(states, name):
    """Class accuracy of one critic over labelled states: among every two candidates of a state
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


def best_kind_order(kind_pairs):
    """The best accuracy of a rule that looks only at what a turn is, one fixed order of kinds in every state
    (e.g. draft > question > answer; ties within a kind), over (better kind, worse kind) pairs: the baseline a
    critic's turn credit must beat. {"order": "draft > question > answer", "accuracy": a}, or None without pairs."""
    best = None
    for order in itertools.permutations(sorted({k for pair in kind_pairs for k in pair})) if kind_pairs else ():
        rank = {kind: -i for i, kind in enumerate(order)}
        hits = [1.0 if rank[a] > rank[b] else 0.5 if rank[a] == rank[b] else 0.0 for a, b in kind_pairs]
        acc = sum(hits) / len(hits)
        if best is None or acc > best["accuracy"]:
            best = {"order": " > ".join(order), "accuracy": acc}
    return best


def kind_order(states):
    """best_kind_order over the class pairs of labelled states (good candidate, bad candidate)."""
    pairs = [(colbench.turn_kind(s["candidates"][i]), colbench.turn_kind(s["candidates"][j]))
             for s in states if s.get("classes")
             for i, ci in enumerate(s["classes"]) for j, cj in enumerate(s["classes"]) if ci == "good" and cj == "bad"]
    return best_kind_order(pairs)


def kind_order_line(k):
    return f"best fixed order of turn kinds (no state): {k['order']} {k['accuracy']:.3f}" if k else ""


def accuracies(states, critics):
    """Every critic's class accuracy (and 'untrained', pi_ref: advantage 0 for every turn), its split by
    kind, and the state-blind kind order beside them."""
    out = {"class_accuracy": {}, "class_pairs": {}}
    for name in [*critics, "untrained"]:
        out["class_accuracy"][name], out["class_pairs"][name] = class_accuracy(states, name)
    return {**out, "by_kind": {name: credit_by_kind(states, name) for name in critics},
            "kind_order": kind_order(states)}


def accuracy_line(acc):
    return ", ".join(f"{k} {v:.3f}" if v is not None else f"{k} -" for k, v in acc.items())


def classes_by_state(states):
    """{(task_id, sample, turn): {candidate text: true class}} for the states that have classes."""
    return {(s["task_id"], s["sample"], s["turn"]): dict(zip(s["candidates"], s["classes"]))
            for s in states if s.get("classes")}


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


def labelled_states(pairs):
    """PAIRS.states.jsonl's rows, each with its true classes from PAIRS.classes.jsonl (where the task has them)
    and every critic's advantages ('sweet': the critic that labelled; 'untrained': pi_ref itself, 0 for every
    turn, since log pi_ref - log pi_ref = 0)."""
    path, classes = Path(f"{pairs}.states.jsonl"), Path(f"{pairs}.classes.jsonl")
    states = [r for _, r in common.read_jsonl(path)] if path.exists() else []
    known = {(r["task_id"], r["sample"], r["turn"]): r for _, r in common.read_jsonl(classes, True)} \
        if classes.exists() else {}
    for s in states:
        row = known.get((s["task_id"], s["sample"], s["turn"]), {})
        if row.get("classes"):
            s["classes"] = row["classes"]
        if row.get("grades"):
            s["grades"] = row["grades"]
        s["advantages_by_critic"] = {"sweet": s["advantages"], **s.get("advantages_by_critic", {}),
                                     "untrained": [0.0] * len(s["candidates"])}
    return states


def critic_forms(pairs):
    """{critic name: its form, e.g. 'ranking paper, normalization turn, ridge 0, lr 0.0001'} from the run settings
    label_turns.py wrote beside PAIRS and each critic's own (train_critic.py's); {} where they are missing."""
    found = [Path(f"{pairs}.run_settings.json"), *common.shard_files(pairs, ".run_settings.json")]
    labelling = [json.loads(f.read_text()) for f in found if f.exists()]
    if not labelling or "critic" not in labelling[0]:
        return {}
    settings = labelling[0]
    dirs = {"sweet": settings["critic"], **dict(kv.split("=", 1) for kv in settings.get("credit_critics", "").split(",")
                                               if "=" in kv)}
    forms = {}
    for name, d in dirs.items():
        path = Path(settings.get("cwd", "."), d, "run_settings.json")
        if path.exists():
            c = json.loads(path.read_text())
            forms[name] = (f"ranking {c.get('ranking', 'paper')}, normalization {c.get('normalization', 'turn')}, "
                           f"ridge {c.get('ridge', 0)}, lr {c.get('lr')}"
                           + (", no training info" if c.get("no_training_info") else ""))
    return forms


def report(out_path):
    """Turn credit of every critic on the labelled states of out_path (label_turns' PAIRS), printed and written to
    PAIRS.credit.json (its "lines" as printed): credit_accuracy on the pairs the reward decides (once the
    Monte-Carlo continuations are graded, PAIRS.mc_graded.jsonl) and the class diagnostics."""
    states = labelled_states(out_path)
    critics = list(dict.fromkeys(k for s in states for k in s["advantages_by_critic"] if k != "untrained"))
    report = {"states": len(states), "states_with_classes": sum("classes" in s for s in states), "lines": [],
              "forms": critic_forms(out_path)}
    values = mc_values(out_path) if Path(mc_paths(out_path)[2]).exists() else {}
    if values or any(s.get("grades") for s in states):  # pairs the reward can decide
        report.update(decided_report(states, values, critics))
        report["lines"].append(mc_line(report))
    if report["states_with_classes"]:
        report.update(accuracies(states, critics))
        pairs = [r for _, r in common.read_jsonl(out_path)] if Path(out_path).exists() else []
        report["dpo_pairs"] = dpo_pair_classes(states, pairs)
        report["lines"] += [
            "diagnostic, class accuracy (candidates of different true classes): "
            + accuracy_line(report["class_accuracy"]) + "; " + kind_order_line(report["kind_order"]),
            "DPO pairs against the true classes: " + ", ".join(f"{k} {v}" for k, v in report["dpo_pairs"].items()),
            "class pairs by kind, each critic in the form that ranked (beside the state-blind order above):",
            *(f"  {name}" + (f" ({report['forms'][name]})" if name in report["forms"] else "") + ": "
              + ", ".join(f"{k} {a:.3f} ({n})" for k, (a, n) in split.items())
              for name, split in report["by_kind"].items())]
    print("\n".join(report["lines"]) or f"{out_path}: no turn credit to report (no classes, no graded values)")
    common.write_text(f"{out_path}.credit.json", json.dumps(report, indent=2))
    return report


def classify(pairs, trajectories, max_turns):
    """Every labelled state's true classes (TrueClasses; null where the task has none) and its answers' grades (code
    tasks) in PAIRS.classes.jsonl, a row a state as it is done: a rerun classifies only the states still missing."""
    key = lambda r: (r["task_id"], r["sample"], r["turn"])
    out = common.ResumableWriter(Path(f"{pairs}.classes.jsonl"), key)
    trajs = {(t["task_id"], t.get("sample", 0)): t for t in trajectories}
    todo = [s for _, s in common.read_jsonl(f"{pairs}.states.jsonl") if not out.finished(key(s))]
    truth = TrueClasses(max_turns)
    for s in common.tqdm_if(todo, bool(todo), "true classes"):
        if (s["task_id"], s["sample"]) not in trajs:
            raise common.DataError(f"{pairs}.states.jsonl: state {key(s)} has no dialogue in --trajectories")
        traj = trajs[(s["task_id"], s["sample"])]
        out.write({"task_id": s["task_id"], "sample": s["sample"], "turn": s["turn"],
                   "classes": truth(traj, s["turn"], s["candidates"]),
                   "grades": truth.grades(traj, s["turn"], s["candidates"])})
    truth.close()
    out.close()


# ----------------------------------------------------------------------------------------------
# Turn credit the reward decides: Monte-Carlo values of the candidates of a fixed sample of states
# ----------------------------------------------------------------------------------------------
def mc_paths(pairs):
    """(the dialogues to continue or grade, their rollouts, graded) beside label_turns' PAIRS."""
    return f"{pairs}.mc.jsonl", f"{pairs}.mc_rollouts.jsonl", f"{pairs}.mc_graded.jsonl"


def is_answer(candidate, turn, max_turns):
    return colbench.ANSWER_MARKER in colbench.split_output(candidate)[0] or turn >= max_turns - 1


def mc_prefixes(states, trajectories, args):
    """The dialogues whose outcomes value the candidates of args.states labelled states (drawn with args.seed
    among those with two distinct candidates): each distinct answer once (its grade is its value) and up to
    args.questions distinct other turns args.continuations times each. A row: {task, sample, dialogue_history,
    mc_state: [task_id, sample, turn], mc_candidate: index in the state's candidates}."""
    trajs = {(t["task_id"], t.get("sample", 0)): t for t in trajectories}
    states = [s for s in states if len(set(s["candidates"])) > 1]
    random.Random(args.seed).shuffle(states)
    rows = []
    for s in states[: args.states]:
        t = trajs[(s["task_id"], s["sample"])]
        rng = random.Random(f"{args.seed}/{s['task_id']}/{s['sample']}/{s['turn']}")
        before, first = state_dialogue(t, s["turn"]), {}
        for ci, c in enumerate(s["candidates"]):
            first.setdefault(c, ci)
        answers = [ci for c, ci in first.items() if is_answer(c, s["turn"], args.max_turns)]
        others = [ci for ci in first.values() if ci not in answers]
        for ci in answers + rng.sample(others, min(args.questions, len(others))):
            content, stored = colbench.split_output(s["candidates"][ci])
            for _ in range(1 if ci in answers else args.continuations):
                rows.append({"task": t["task"], "sample": len(rows), "mc_state": [s["task_id"], s["sample"], s["turn"]],
                             "mc_candidate": ci, "exact": ci in answers,
                             "dialogue_history": [*before, {"role": "assistant", "content": content,
                                                            "output": stored}]})
    return rows


def mc_values(pairs):
    """{(task_id, sample, turn): {candidate index: (exact, [outcomes])}} from the graded continuations; the outcome
    is the reward (the share of tests or of design facts right; ColBench pages: the similarity)."""
    prefixes, _, graded = mc_paths(pairs)
    which = {r["sample"]: r for _, r in common.read_jsonl(prefixes)}
    values = {}
    for _, r in common.read_jsonl(graded):
        p = which[r["sample"]]
        candidate = values.setdefault(tuple(p["mc_state"]), {}).setdefault(p["mc_candidate"], (p["exact"], []))
        candidate[1].append(float(r["reward"]))
    return values


def mean_and_variance(exact, xs):
    """A candidate's value and the variance of that estimate: 0 for an answer's grade; for continuations the
    sample variance shrunk toward 0.25 (the most a 0-1 outcome has) by one pseudo-observation, over n."""
    m = sum(xs) / len(xs)
    if exact:
        return m, 0.0
    return m, (sum((x - m) ** 2 for x in xs) + 0.25) / len(xs) / len(xs)


def decided_pairs(values, z=1.96):
    """[(state key, better index, worse index, halves agree: 1 / 0.5 / 0)] for every two valued candidates of a
    state whose values differ by more than z standard errors (two exact values: by anything). The halves are
    the even and odd continuations, each ordering the pair on its own (an answer's grade serves both)."""
    out = []
    for key, cands in values.items():
        for (i, (ei, xi)), (j, (ej, xj)) in itertools.combinations(sorted(cands.items()), 2):
            (mi, vi), (mj, vj) = mean_and_variance(ei, xi), mean_and_variance(ej, xj)
            if mi == mj or abs(mi - mj) <= z * math.sqrt(vi + vj):
                continue
            hi, lo = (i, j) if mi > mj else (j, i)
            half = lambda k, h: (lambda xs: sum(xs) / len(xs))(cands[k][1] if cands[k][0] else cands[k][1][h::2])
            signs = [(half(hi, h) > half(lo, h)) - (half(hi, h) < half(lo, h)) for h in (0, 1)]
            out.append((key, hi, lo, 1.0 if signs[0] == signs[1] != 0 else 0.5 if 0 in signs else 0.0))
    return out


def exact_pairs(states, skip=()):
    """[(state key, better, worse, 1.0)] for every two answers of a labelled state whose rewards differ (code tasks;
    the answers' rewards from classify): the reward orders them exactly, at no cost beyond grading. The states
    valued by continuations (skip) are left to decided_pairs, which grades their answers the same way."""
    out = []
    for s in states:
        key = (s["task_id"], s["sample"], s["turn"])
        if key not in skip:
            grades = itertools.permutations(s.get("grades", []), 2)
            out += [(key, i, j, 1.0) for (i, a), (j, b) in grades if a > b]
    return out


def bootstrap_over_states(hits, n=2000, seed=0):
    """95% interval of an accuracy whose pairs come in states ({state: [hit, ...]}): the states resampled."""
    rng, keys, accs = random.Random(seed), list(hits), []
    for _ in range(n):
        sample = [h for k in (rng.choice(keys) for _ in keys) for h in hits[k]]
        accs.append(sum(sample) / len(sample))
    accs.sort()
    return [accs[int(0.025 * n)], accs[int(0.975 * n) - 1]]


def decided_report(states, values, critics):
    """credit_accuracy of every critic on the pairs the reward decides: two answers of different rewards (exact, in
    every labelled state of a code task) and the pairs the Monte-Carlo values of the valued states decide; each with
    its 95% interval (states resampled), by kind of pair, beside the split-half agreement of the values (the
    ceiling) and the best state-blind order of turn kinds on the same pairs."""
    by_key = {(s["task_id"], s["sample"], s["turn"]): s for s in states}
    valued = [d for d in decided_pairs(values) if d[0] in by_key]
    decided = exact_pairs(states, skip=set(values)) + valued
    hit = lambda adv, i, j: 1.0 if adv[i] > adv[j] else 0.5 if adv[i] == adv[j] else 0.0
    answers = {k: {i for i, _ in by_key[k].get("grades", [])} | {i for i, (exact, _) in values.get(k, {}).items()
                                                                 if exact} for k in by_key}  # the last turn's too
    kind = lambda k, i: "answer" if i in answers[k] else colbench.turn_kind(by_key[k]["candidates"][i])
    acc, ci, by_kind = {}, {}, {}
    for name in [*critics, "untrained"]:
        adv = lambda s: ([0.0] * len(s["candidates"]) if name == "untrained"
                         else s.get("advantages_by_critic", {}).get(name))
        hits = {}
        for k, i, j, _ in decided:
            if adv(by_key[k]) is not None:
                hits.setdefault(k, []).append(hit(adv(by_key[k]), i, j))
                by_kind.setdefault(f"{kind(k, i)} > {kind(k, j)}", {}).setdefault(name, []).append(hits[k][-1])
        flat = [h for v in hits.values() for h in v]
        acc[name] = sum(flat) / len(flat) if flat else None
        ci[name] = bootstrap_over_states(hits) if flat else None
    best = best_kind_order([(kind(k, i), kind(k, j)) for k, i, j, _ in decided])
    return {"credit_accuracy": acc, "credit_accuracy_ci95": ci, "credit_pairs": len(decided),
            "credit_pairs_exact": len(decided) - len(valued), "credit_states": len(values),
            "credit_split_half": sum(d[3] for d in valued) / len(valued) if valued else None,
            "credit_kind_order": best,
            "credit_pairs_by_kind": {k: len(next(iter(v.values()))) for k, v in sorted(by_kind.items())},
            "credit_by_kind": {k: {name: round(sum(h) / len(h), 4) for name, h in v.items()}
                               for k, v in sorted(by_kind.items())}}


def mc_line(r):
    """credit_accuracy with its interval, its ceiling and the state-blind baseline, in words."""
    if not r.get("credit_pairs"):
        return (f"turn-credit accuracy: no pair of candidates the reward decides "
                f"({r.get('credit_states', 0)} states valued)")
    ci = lambda name: "[{:.3f}, {:.3f}]".format(*r["credit_accuracy_ci95"][name]) if r["credit_accuracy_ci95"][name] \
        else ""
    half = r["credit_split_half"]
    return (f"turn-credit accuracy on the {r['credit_pairs']} pairs the reward decides ({r['credit_pairs_exact']} "
            f"answers of different rewards, {r['credit_pairs'] - r['credit_pairs_exact']} by the values of "
            f"{r['credit_states']} states): "
            + ", ".join(f"{k} {v:.3f} {ci(k)}" if v is not None else f"{k} -" for k, v in r["credit_accuracy"].items())
            + (f"\n  split-half agreement of the values (the ceiling) {half:.3f}" if half is not None else "")
            + "\n  " + kind_order_line(r["credit_kind_order"])
            + "".join(f"\n  {k} ({r['credit_pairs_by_kind'][k]}): " + ", ".join(f"{n} {a:.3f}" for n, a in v.items())
                      for k, v in r["credit_by_kind"].items()))


@dataclass
class Args:
    pairs: str
    """label_turns.py's output (its PAIRS.states.jsonl holds the candidates); writes PAIRS.mc.jsonl"""
    trajectories: str
    """the graded dialogues label_turns.py read (the states' dialogues)"""
    max_turns: int = 10
    """the rollouts' --max_turns: a candidate at the last turn is an answer"""
    states: int = 12
    """labelled states to value by Monte Carlo (a fixed sample, drawn with --seed; 0: none)"""
    continuations: int = 16
    """dialogues after each non-answer candidate"""
    questions: int = 2
    """non-answer candidates valued per state (distinct texts, drawn at random); every distinct answer is"""
    seed: int = 0


def main(args):
    common.refuse(args.continuations < 2 and "--continuations must be at least 2 (two halves)",
                  args.states < 0 and "--states must be >= 0 (0: no Monte-Carlo values)",
                  not Path(f"{args.pairs}.states.jsonl").exists()
                  and f"{args.pairs}.states.jsonl: not found (run label_turns.py)")
    common.save_run_settings(f"{args.pairs}.credit.run_settings.json", args)
    trajectories = colbench.load_graded(args.trajectories)
    classify(args.pairs, trajectories, args.max_turns)
    out = mc_paths(args.pairs)[0]
    if args.states and not Path(out).exists():
        rows = mc_prefixes([r for _, r in common.read_jsonl(f"{args.pairs}.states.jsonl")], trajectories, args)
        common.write_jsonl(out, rows)  # empty when no labelled state has two distinct candidates: nothing to value
        print(f"wrote {out}: {len(rows)} dialogues to continue or grade ({sum(r['exact'] for r in rows)} answers)")
    report(args.pairs)


if __name__ == "__main__":
    common.run(main, Args, __doc__)
