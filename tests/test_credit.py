"""Ground-truth turn credit (procedural tasks + the scripted human), the hasty oracle of the warm-up,
turn-credit accuracy, trajectory pairing rules, and the results' bootstrap intervals."""
import json
import random
import re
import types

import pytest

import colbench
import colbench.oracle
import colbench.tasks
import common
import credit
import evaluate
from colbench import sandbox
from conftest import run_script


def task(family, seed=0):
    t = colbench.tasks.procedural_task(random.Random(seed), family)
    t["task_id"] = colbench.task_id(t)
    return t


def test_turn_classes_follow_the_rules():
    t = task("fee")
    start = [{"role": "user", "content": t["problem_description"]}]
    facts = t["hidden_information"].splitlines()
    question = colbench.oracle.oracle_question(facts[0])
    assert credit.turn_class(t, start, question) == "good"  # reveals a fact not yet known
    assert credit.turn_class(t, start, "Should the code print anything?") == "bad"  # reveals nothing
    after = start + [{"role": "assistant", "content": question},
                     {"role": "user", "content": colbench.scripted_reply(t["hidden_information"], question)}]
    assert colbench.revealed_facts(t, after) == {facts[0]}  # one fact a reply
    assert credit.turn_class(t, after, question) == "bad"  # asking again reveals nothing new
    for f in facts[1:]:
        q = colbench.oracle.oracle_question(f)
        after += [{"role": "assistant", "content": q}, {"role": "user", "content": colbench.scripted_reply(t["hidden_information"], q)}]
    assert colbench.revealed_facts(t, after) == set(facts) and len(facts) == 2
    assert credit.turn_class(t, after, f"{colbench.ANSWER_MARKER}\n{t['ground_truth']}") == "good"
    wrong = t["ground_truth"].replace("return ", "return 1 + ")
    assert credit.turn_class(t, after, f"{colbench.ANSWER_MARKER}\n{wrong}") == "bad"
    # at the last allowed turn, whatever the agent writes is its answer
    assert credit.turn_class(t, after, t["ground_truth"], last_turn=True) == "good"
    assert credit.turn_class(t, after, question, last_turn=True) == "bad"


def oracle(hasty, mistake, seed=0, max_turns=10):
    return colbench.oracle.OracleAgent.__new__(colbench.oracle.OracleAgent), types.SimpleNamespace(
        seed=seed, oracle_hasty=hasty, oracle_mistake=mistake, max_turns=max_turns)


GT = {}  # task_id -> the ground truth's results (sandboxed once per task)


def play(agent, t, sample):
    """One oracle dialogue against the scripted human (in process); returns (dialogue, success)."""
    ep = {"task": t, "sample": sample, "task_type": "code", "dialogue": [{"role": "user", "content": t["problem_description"]}]}
    while True:
        out = agent.generate([None], [ep])[0]
        ep["dialogue"].append({"role": "assistant", "content": out})
        if colbench.ANSWER_MARKER in out:
            if t["task_id"] not in GT:
                GT[t["task_id"]] = sandbox.run_calls(t["ground_truth"], list(t["test_cases"].items()))
            return ep["dialogue"], sandbox.grade_code(t, colbench.extract_answer(out), gt_results=GT[t["task_id"]])["success"]
        ep["dialogue"].append({"role": "user", "content": colbench.scripted_reply(t["hidden_information"], out)})


def test_hasty_oracle_mix_is_seeded_and_guesses_fail():
    tasks = [task(f, s) for f in sorted(colbench.tasks.FAMILIES) for s in range(5)]
    results = {}
    for hasty, mistake in ((0.0, 0.0), (1.0, 0.0), (0.5, 0.5)):
        agent, agent.args = oracle(hasty, mistake)
        results[hasty, mistake] = [play(agent, t, 0) for t in tasks]
    assert all(ok for _, ok in results[0.0, 0.0])  # the complete oracle always succeeds
    # always hasty: each dialogue stops asking after fewer facts than there are, and the guessed constants fail
    early = [ok for (d, ok), t in zip(results[1.0, 0.0], tasks)
             if colbench.revealed_facts(t, d) != set(t["hidden_information"].splitlines())]
    assert len(early) == len(tasks) and not any(early)
    mixed = results[0.5, 0.5]
    assert 0.2 < sum(ok for _, ok in mixed) / len(mixed) < 0.9
    detours = sum(m["content"] in colbench.oracle.DETOURS for d, _ in mixed for m in d)
    assert detours > 0
    # a wasted question asks again about a revealed fact (a repeat) or about nothing the facts cover
    repeats = [(t, d[:i], m["content"]) for (d, _), t in zip(mixed, tasks) for i, m in enumerate(d)
               if m["role"] == "assistant" and colbench.ANSWER_MARKER not in m["content"]
               and m["content"] not in colbench.oracle.DETOURS and credit.turn_class(t, d[:i], m["content"]) == "bad"]
    assert repeats and all(colbench.revealed_facts(t, before) for t, before, _ in repeats)
    # a wasted question spends a hasty dialogue's budget: with every question wasted, no fact is learned
    agent, agent.args = oracle(1.0, 1.0)
    wasted = [play(agent, t, 0) for t in tasks]
    assert all(not colbench.revealed_facts(t, d) for (d, _), t in zip(wasted, tasks))
    assert sum(len(d) > 2 for d, _ in wasted) >= 6  # and the budget was spent asking, not answering at once
    agent, agent.args = oracle(0.5, 0.5)  # same seed, same dialogues
    assert [play(agent, t, 0) for t in tasks] == mixed


def play_until(agent, t, sample, max_turns):
    """play(), for dialogues that may never answer: (dialogue, success or None when it did not answer)."""
    ep = {"task": t, "sample": sample, "task_type": "code", "dialogue": [{"role": "user", "content": t["problem_description"]}]}
    for _ in range(max_turns):
        out = agent.generate([None], [ep])[0]
        ep["dialogue"].append({"role": "assistant", "content": out})
        if colbench.ANSWER_MARKER in out:
            return ep["dialogue"], sandbox.grade_code(t, colbench.extract_answer(out))["success"]
        ep["dialogue"].append({"role": "user", "content": colbench.scripted_reply(t["hidden_information"], out)})
    return ep["dialogue"], None


def test_class_accuracy_counts_ties_half():
    states = [{"classes": ["good", "bad", "bad"], "advantages_by_critic": {"a": [1.0, 0.0, 2.0], "u": [0.0, 0.0, 0.0]}},
              {"classes": ["good", "good"], "advantages_by_critic": {"a": [0.0, 1.0], "u": [0.0, 0.0]}},  # no mixed pair
              {"classes": ["bad", "good"], "advantages_by_critic": {"a": [0.0, 0.5], "u": [0.0, 0.0]}},
              {"candidates": ["x"]}]  # a state without classes (not a procedural task)
    assert credit.class_accuracy(states, "a") == (pytest.approx(2 / 3), 3)
    assert credit.class_accuracy(states, "u") == (0.5, 3)
    assert credit.class_accuracy(states, "missing") == (None, 0)


def test_kind_order_is_the_best_state_blind_ranking_of_turn_kinds():
    """credit.kind_order: the best accuracy over every fixed order of turn kinds, ties within a kind half."""
    answer = lambda page: f"{colbench.ANSWER_MARKER} <html><body>{page}</body></html>"
    draft = "Here is a draft: <html><body>a</body></html>"
    states = [{"candidates": [draft, "What colour?", answer("a")], "classes": ["good", "bad", "bad"]},
              {"candidates": ["What size?", answer("x")], "classes": ["good", "bad"]},
              {"candidates": [answer("y"), "Which font?"], "classes": ["good", "bad"]},  # here answering is right
              {"candidates": ["Which font?", answer("z")], "classes": ["good", "bad"]},
              {"candidates": ["Ask a?", "Ask b?"], "classes": ["good", "bad"]},  # one kind: a tie, half
              {"candidates": ["no classes"]}]
    # draft > question > answer: 2 + 1 + 0 + 1 + 0.5 of 6; draft > answer > question gets 2 + 0 + 1 + 0 + 0.5
    assert credit.kind_order(states) == {"order": "draft > question > answer", "accuracy": pytest.approx(4.5 / 6)}
    assert credit.kind_order([{"candidates": ["x"]}]) is None


def test_dpo_pair_classes_judge_each_pair_by_its_state(tmp_path):
    key = {"task_id": "t", "sample": 0}
    states = [{**key, "turn": 0, "candidates": ["ask x", "answer", "ask y"], "classes": ["good", "bad", "bad"]},
              {**key, "turn": 1, "candidates": ["ask x", "answer"], "classes": ["bad", "good"]},  # same text, other class
              {**key, "turn": 2, "candidates": ["a", "b"]}]  # no classes: its pairs are not counted
    pairs = [{**key, "turn": 0, "chosen": "ask x", "rejected": "answer"},  # right
             {**key, "turn": 0, "chosen": "answer", "rejected": "ask y"},  # both bad
             {**key, "turn": 1, "chosen": "ask x", "rejected": "answer"},  # wrong at turn 1
             {**key, "turn": 2, "chosen": "a", "rejected": "b"}]
    assert credit.dpo_pair_classes(states, pairs) == {"right": 1, "wrong": 1, "same_class": 1}
    # bench/true_class_pairs.py, the ceiling of the critic's labels: a run's pairs put right by those classes
    run, out = tmp_path / "run", tmp_path / "true_class"
    (run / "critic").mkdir(parents=True), (run / "policy_sweet").mkdir()
    (run / "critic" / "config.json").write_text("{}"), (run / "val_sweet_end.jsonl").write_text("")
    common.write_jsonl(run / "pairs.jsonl", [{**p, "chosen_advantage": 1.0, "rejected_advantage": 0.0} for p in pairs])
    common.write_jsonl(run / "pairs.jsonl.states.jsonl", [{**s, "classes": None, "advantages": [0.0] * len(
        s["candidates"])} for s in states])  # the classes are credit.py's, in their own file
    common.write_jsonl(run / "pairs.jsonl.classes.jsonl", [{**key, "turn": s["turn"], "classes": s.get("classes", []),
                                                            "grades": []} for s in states])
    (run / "pairs.jsonl.run_settings.json").write_text("{}")
    report = json.loads(run_script("bench/true_class_pairs.py", run, out).stdout)
    assert report == {"pairs": 2, "flipped": 1, "dropped_same_class": 2, "output": str(out)}
    assert [(p["turn"], p["chosen"], p["rejected"], p["chosen_advantage"]) for _, p in common.read_jsonl(
        out / "pairs.jsonl")] == [(0, "ask x", "answer", 1.0), (1, "answer", "ask x", 0.0)]
    assert (out / "critic" / "config.json").exists() and not (out / "policy_sweet").exists()
    assert not (out / "val_sweet_end.jsonl").exists() and not (out / "pairs.jsonl.classes.jsonl").exists()


def test_trajectory_pairs_rules():
    row = lambda t, s, r: {"task_id": t, "sample": s, "reward": r, "success": r == 1.0}
    rows = [row("a", 0, 1.0), row("a", 1, 0.5), row("a", 2, 1.0), row("a", 3, 0.0),  # best succeeds: pairs with lower ones
            row("b", 0, 0.9), row("b", 1, 0.1),  # best does not succeed: no pair (code)
            row("c", 0, 1.0)]  # a single sample: no pair
    pairs = colbench.trajectory_pairs(rows, "code")
    assert [(c["task_id"], c["sample"], r["sample"]) for c, r in pairs] == [("a", 0, 1), ("a", 0, 3)]  # ties never pair
    page = lambda t, s, r: {"task_id": t, "sample": s, "reward": r}  # ColBench's pages: a similarity, no success
    html = colbench.trajectory_pairs([page("h", 0, 0.8), page("h", 1, 0.75), page("h", 2, 0.6), page("h", 3, 0.2)], "html")
    assert [(c["sample"], r["sample"]) for c, r in html] == [(0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]  # gap >= 0.1, not 0.05
    # procedural pages (reward: the share of design facts right; success: all of them) follow the backend's rule
    facts = [row("p", 0, 0.8), row("p", 1, 1.0), row("p", 2, 0.6), row("p", 3, 1.0), row("q", 0, 0.8), row("q", 1, 0.4)]
    assert [(c["task_id"], c["sample"], r["sample"]) for c, r in colbench.trajectory_pairs(facts, "html")] == \
        [("p", 1, 0), ("p", 1, 2)]


def test_compare_reports_bootstrap_and_paired_intervals(tmp_path):
    t = task("fee")
    def graded(name, successes):
        path = tmp_path / f"{name}.jsonl"
        rows = [{"task": t, "task_id": f"t{i}", "sample": 0, "dialogue_history": [], "answer": "", "reward": float(s),
                 "success": bool(s), "num_turns": 1 + s * (2 + i % 2), "finish": "max_turns" if i % 4 == 1 and not s else "answered"}
                for i, s in enumerate(successes)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path
    base = [1, 0] * 20
    better = [1, 1] * 20
    a, b = graded("a", base), graded("b", better)
    out = run_script("evaluate.py", "--compare", f"zero_shot={a},sweet_rl={b}", "--policies", "zero_shot=p0,sweet_rl=p1",
                     "--summary", tmp_path / "r.json")
    res = json.loads((tmp_path / "r.json").read_text())
    # how long the dialogues ran: base 20 of 3 turns and 20 of 1, better 20 of 3 and 20 of 4; base's failures at
    # i = 1, 5, 9, ... (10 of 40) never answered
    assert res["methods"]["zero_shot"]["mean_turns"] == 2.0 and res["methods"]["sweet_rl"]["mean_turns"] == 3.5
    assert res["methods"]["zero_shot"]["answered_rate"] == 0.75 and res["methods"]["sweet_rl"]["answered_rate"] == 1.0
    assert "agent turns (mean), answered: zero_shot 2.00, 75%, sweet_rl 3.50, 100%" in out.stdout
    assert res["num_test_tasks"] == 40
    z, s = res["methods"]["zero_shot"], res["methods"]["sweet_rl"]
    assert z["success"] == 0.5 and s["success"] == 1.0 and s["policy"] == "p1"
    assert z["ci95"][0] < 0.5 < z["ci95"][1] and 0.3 < z["ci95"][0] and z["ci95"][1] < 0.7
    assert s["ci95"] == [1.0, 1.0]
    d = res["paired_vs_zero_shot"]["sweet_rl"]
    assert d["diff"] == 0.5 and 0.3 < d["ci95"][0] < 0.5 < d["ci95"][1] < 0.7
    # every method against every other, with the same fields: here the other way round
    back = res["paired_vs_sweet_rl"]["zero_shot"]
    assert back["diff"] == -0.5 and back["ci95"][0] < -0.5 < back["ci95"][1] < -0.3
    lo, hi = evaluate.bootstrap_ci([0.0] * 10 + [1.0] * 10, 4000)  # +-1.96 * sqrt(.25 / 20) = +-0.22
    assert lo == pytest.approx(0.28, abs=0.05) and hi == pytest.approx(0.72, abs=0.05)
    # pooled over draws (NAME=draw+draw): the second draw reuses the first's task ids, and its tasks still count
    # on their own: 80 tasks, zero-shot 0.5 in both, sweet_rl 1.0 then 0.5, so a paired +0.25 over the pool
    a2, b2 = graded("a2", base), graded("b2", base)
    pooled = evaluate.main(common.parse_args(evaluate.Args, argv=[
        "--compare", f"zero_shot={a}+{a2},sweet_rl={b}+{b2}"]))
    assert pooled["num_test_tasks"] == 80 and pooled["methods"]["sweet_rl"]["success"] == 0.75
    p = pooled["paired_vs_zero_shot"]["sweet_rl"]
    assert p["diff"] == 0.25 and 0.1 < p["ci95"][0] < 0.25 < p["ci95"][1] < 0.4
    with pytest.raises(common.DataError, match="as many draws"):
        evaluate.main(common.parse_args(evaluate.Args, argv=["--compare", f"zero_shot={a}+{a2},sweet_rl={b}"]))


def graded_code_rows(path, successes):
    """a graded code run of one task per success value (the validation files --select compares)"""
    t = task("fee")
    path.write_text("".join(json.dumps({"task": t, "task_id": f"t{i}", "sample": 0, "dialogue_history": [], "answer": "",
                                        "reward": float(s), "success": bool(s)}) + "\n" for i, s in enumerate(successes)))
    return path


def test_select_keeps_the_best_and_the_earliest_of_a_tie(tmp_path):
    """--select (run.sh's checkpoint selection on validation tasks): the highest success wins; on a tie the
    run listed first (the starting policy) is kept, so an update that helps nothing is not taken."""
    graded = lambda name, successes: graded_code_rows(tmp_path / f"{name}.jsonl", successes)
    start, worse, better, same = graded("s", [1, 0, 1, 0]), graded("w", [0, 0, 1, 0]), graded("b", [1, 1, 1, 0]), graded("e", [0, 1, 0, 1])
    for runs, chosen in (((start, worse, better), "c"), ((start, worse, same), "a"), ((start, same, worse), "a")):
        names = "abc"
        run_script("evaluate.py", "--compare", ",".join(f"{n}={p}" for n, p in zip(names, runs)), "--select",
                   "--policies", ",".join(f"{n}=dir_{n}" for n in names), "--summary", tmp_path / "sel.json")
        res = json.loads((tmp_path / "sel.json").read_text())
        assert (res["selected"], res["selected_policy"]) == (chosen, f"dir_{chosen}")


def test_dialogue_outcome_splits_informed_hasty_and_unanswered():
    t = task("fee")
    facts = colbench.hidden_facts(t)
    ask = {"role": "assistant", "content": "What is the fee?"}
    answer = {"role": "assistant", "content": colbench.ANSWER_MARKER + " def f(): pass"}
    told = {"role": "user", "content": " ".join(facts)}
    req = {"role": "user", "content": t["problem_description"]}
    row = lambda d, ok, finish="answered": {"task": t, "dialogue_history": d, "success": ok, "finish": finish}
    assert colbench.dialogue_outcome(row([req, ask, told, answer], True)) == "informed_pass"
    assert colbench.dialogue_outcome(row([req, ask, told, answer], False)) == "informed_fail"
    assert colbench.dialogue_outcome(row([req, answer], False)) == "hasty_fail"
    assert colbench.dialogue_outcome(row([req, ask, {"role": "user", "content": "I don't know."}, answer], True)) == "hasty_pass"
    assert colbench.dialogue_outcome(row([req, ask, told], False, "max_turns")) == "no_answer"


def test_guessed_answers_do_not_depend_on_the_string_hash_seed():
    """guess_answer replaces constants in a fixed order: the warm-up data is the same in every process
    (set order follows PYTHONHASHSEED, which differs per process)."""
    import subprocess
    import sys
    from conftest import ROOT
    code = ("import random, colbench.oracle, colbench.tasks\n"
            "fam = sorted(colbench.tasks.FAMILIES)\n"
            "for f in fam:\n"
            "    for s in range(6):\n"
            "        t = colbench.tasks.procedural_task(random.Random(s), f)\n"
            "        print(colbench.oracle.guess_answer(t, set(), random.Random(s)))\n")
    outs = {subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": str(h)}).stdout for h in range(4)}
    assert len(outs) == 1 and "def " in outs.pop()


def test_oracle_mistakes_waste_turns_and_slip_and_a_tight_budget_makes_waste_cost_the_outcome():
    tasks = [task(f, s) for f in sorted(colbench.tasks.FAMILIES) for s in range(6)]
    agent, agent.args = oracle(0.0, 0.35, max_turns=4)
    games = [(t, *play(agent, t, k)) for t in tasks for k in range(3)]
    facts = lambda t: set(colbench.hidden_facts(t))
    wasted = lambda t, d: sum(m["role"] == "assistant" and colbench.ANSWER_MARKER not in m["content"]
                              and credit.turn_class(t, d[:i], m["content"]) == "bad" for i, m in enumerate(d))
    informed = [(t, d, ok) for t, d, ok in games if colbench.revealed_facts(t, d) == facts(t)]
    # a slip: every fact heard, and the answer breaks one of them (the others' constants kept)
    slips = [(t, d) for t, d, ok in informed if not ok]
    assert slips and any(ok for *_, ok in informed)
    for t, d in slips:
        answer = colbench.extract_answer(d[-1]["content"])
        assert answer != t["ground_truth"].strip()
        kept = [f for f in facts(t) if all(re.search(rf"\b{c}\b", answer) if c.isdigit() else c[1:-1] in answer
                                           for c in colbench.oracle.CONSTANT.findall(f))]
        assert len(kept) == 1, (t["hidden_information"], answer)
    # successes that hold a wasted turn, and failures whose wasted turns spent the budget before every fact was heard
    assert any(ok and wasted(t, d) for t, d, ok in games)
    spent = [(t, d) for t, d, ok in games if not ok and colbench.revealed_facts(t, d) != facts(t)]
    assert spent and all(wasted(t, d) >= 2 and sum(m["role"] == "assistant" for m in d) == 4 for t, d in spent)


def test_credit_accuracy_counts_only_the_pairs_the_reward_decides():
    key = ("t", 0, 1)
    values = {key: {0: (True, [1.0]), 1: (True, [0.0]), 2: (False, [1.0] * 8 + [0.0] * 8),
                    3: (False, [1.0] * 9 + [0.0] * 7), 4: (True, [1.0])}}
    decided = credit.decided_pairs(values)
    got = {(i, j) for _, i, j, _ in decided}
    # exact grades differ by anything; 8/16 against an exact 1 or 0 is decided; 8/16 against 9/16 is not,
    # nor are two equal exact grades
    assert got == {(0, 1), (0, 2), (0, 3), (2, 1), (3, 1), (4, 1), (4, 2), (4, 3)}
    # the halves: 2's even continuations are [1]*4 + [0]*4, its odd the same, so every pair agrees with itself
    assert all(agree == 1.0 for *_, agree in decided)
    states = [{"task_id": "t", "sample": 0, "turn": 1,
               "candidates": [f"{colbench.ANSWER_MARKER} a", f"{colbench.ANSWER_MARKER} b", "q1?", "q2?", f"{colbench.ANSWER_MARKER} c"],
               "advantages_by_critic": {"good": [3.0, 0.0, 1.0, 1.0, 3.0], "kinds": [0.0, 0.0, 1.0, 1.0, 0.0]}}]
    r = credit.decided_report(states, values, ["good", "kinds"])
    assert r["credit_pairs"] == 8 and r["credit_accuracy"]["good"] == 1.0 and r["credit_accuracy"]["untrained"] == 0.5
    # a question ranked over every answer: right on the 2 pairs a question wins, ties on the 2 of two answers
    assert r["credit_accuracy"]["kinds"] == pytest.approx((2 + 2 * 0.5) / 8)
    assert r["credit_kind_order"] == {"order": "answer > question", "accuracy": pytest.approx((4 + 2 * 0.5) / 8)}
    assert r["credit_split_half"] == 1.0
    assert r["credit_pairs_by_kind"] == {"answer > answer": 2, "answer > question": 4, "question > answer": 2}
    assert r["credit_by_kind"]["question > answer"] == {"good": 1.0, "kinds": 1.0, "untrained": 0.5}
    lo, hi = r["credit_accuracy_ci95"]["kinds"]  # one state: every resample is that state
    assert lo == hi == pytest.approx(r["credit_accuracy"]["kinds"])
    # every other labelled state: two answers of different rewards (the share of tests passed) are decided exactly,
    # without continuations; equal rewards are not
    other = {"task_id": "t", "sample": 1, "turn": 0, "candidates": ["a", "b", "q?", "c", "d"],
             "grades": [[0, 0.0], [1, 1.0], [3, 1.0], [4, 0.5]],
             "advantages_by_critic": {"good": [0.0, 1.0, 5.0, -1.0, 0.5]}}
    assert {(i, j) for _, i, j, _ in credit.exact_pairs([other])} == {(1, 0), (3, 0), (1, 4), (3, 4), (4, 0)}
    r = credit.decided_report([*states, other], values, ["good"])
    assert r["credit_pairs"] == 13 and r["credit_pairs_exact"] == 5
    assert r["credit_accuracy"]["good"] == pytest.approx(11 / 13)  # c > a and c > d are ordered wrong
    assert r["credit_by_kind"]["answer > answer"]["good"] == pytest.approx(5 / 7, abs=1e-4)
    lo, hi = r["credit_accuracy_ci95"]["good"]
    assert lo == pytest.approx(0.6) and hi == 1.0  # the states resampled: the other state's 3/5 up to the first's 8/8
    assert credit.exact_pairs([other], skip={("t", 1, 0)}) == []  # a valued state: its answers are in its values
    # halves that disagree lower the ceiling: 16 continuations whose even half all fail and odd half all pass
    flip = {key: {0: (False, [0.0, 1.0] * 8), 1: (True, [0.0])}}
    assert credit.decided_pairs(flip) == [(key, 0, 1, 0.5)]  # the even half ties the exact 0


def test_mc_prefixes_grade_each_distinct_answer_once_and_continue_the_other_turns(tmp_path):
    t = task("fee")
    traj = {"task": t, "task_id": t["task_id"], "sample": 0, "reward": 0.0, "dialogue_history": [
        {"role": "user", "content": t["problem_description"]},
        {"role": "assistant", "content": "q?", "input": "p0", "output": "q?"}, {"role": "user", "content": "I don't know"},
        {"role": "assistant", "content": "a", "input": "p1", "output": "a"}]}
    ans = f"{colbench.ANSWER_MARKER} x"
    states = [{"task_id": t["task_id"], "sample": 0, "turn": 1, "candidates": [ans, ans, "q1?", "q2?", "q3?", "q1?"]},
              {"task_id": t["task_id"], "sample": 0, "turn": 0, "candidates": ["same"] * 3}]  # one text: nothing to order
    args = types.SimpleNamespace(states=5, questions=2, continuations=4, seed=0, max_turns=10)
    rows = credit.mc_prefixes(states, [traj], args)
    assert {tuple(r["mc_state"]) for r in rows} == {(t["task_id"], 0, 1)}
    counts = {}
    for r in rows:
        counts[r["mc_candidate"]] = counts.get(r["mc_candidate"], 0) + 1
        assert r["dialogue_history"][:-1] == traj["dialogue_history"][:3] and r["dialogue_history"][-1]["role"] == "assistant"
    assert counts.pop(0) == 1 and len(counts) == 2 and set(counts.values()) == {4} and set(counts) <= {2, 3, 4}
    assert [r["sample"] for r in rows] == list(range(len(rows)))
    args.max_turns = 2  # at the last allowed turn every candidate is an answer: graded once each
    assert sorted(r["mc_candidate"] for r in credit.mc_prefixes(states, [traj], args)) == [0, 2, 3, 4]
