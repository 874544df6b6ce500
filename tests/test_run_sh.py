"""run.sh end to end on a tiny random model and a handful of tasks (every stage, baselines included)."""
import json
import os
import subprocess
import sys

import pytest

import colbench
import credit
from conftest import ROOT


def test_run_sh_end_to_end(tiny_model, tmp_path):
    env = {**os.environ, "SETUP": "0", "PY": sys.executable, "RUN": str(tmp_path / "run"), "MODEL": tiny_model,
           "WARMUP": "0", "N_TRAIN": "3", "N_TEST": "2", "SAMPLES": "1", "ORACLE_SAMPLES": "1", "CANDIDATES": "2",
           "PAIRS_PER_STATE": "2", "DATA_FRACTION": "1.0", "MAX_TURNS": "2", "MAX_NEW_TOKENS": "8", "BASELINES": "1",
           "LR_CRITIC": "1e-3", "LR_DPO": "1e-3", "CRITIC_EPOCHS": "1", "OMP_NUM_THREADS": "1", "CREDIT_VARIANTS": "2",
           "N_VAL": "2", "VAL_SAMPLES": "1", "SELECT_SIGNIFICANT": "1", "DECISION_TERMS": "1"}
    p = subprocess.run(["bash", str(ROOT / "run.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    table = (tmp_path / "run" / "results.txt").read_text()
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    # each update was selected on the 2 validation tasks (disjoint from train and test) against its start
    val = {t["task_id"] for t in read(tmp_path / "run" / "val_tasks.jsonl")}
    assert len(val) == 2 and not val & {t["task_id"] for f in ("train", "test") for t in read(tmp_path / "run" / f"{f}_tasks.jsonl")}
    for name, method in (("sweet", "sweet_rl"), ("mtdpo", "multi_turn_dpo"), ("rft", "rejection_ft")):
        sel = json.loads((tmp_path / "run" / f"select_{name}.json").read_text())
        assert list(sel["methods"])[0] == "start" and f"{name}_end" in sel["methods"]
        assert res["methods"][method]["policy"] == sel["selected_policy"]
    # SELECT_SIGNIFICANT=1: on 2 validation tasks no gain of the tiny model's clears its interval, so each update
    # keeps its start, and its test dialogues are zero_shot's, not rolled out again
    assert {res["methods"][m]["policy"] for m in res["methods"]} == {res["methods"]["zero_shot"]["policy"]}
    zero_shot = (tmp_path / "run" / "test_zero_shot.jsonl").read_bytes()
    for method in ("sweet_rl", "multi_turn_dpo", "rejection_ft"):
        assert (tmp_path / "run" / f"test_{method}.jsonl").read_bytes() == zero_shot
        assert f"{method} is the starting policy: its test dialogues are zero_shot's" in p.stdout
        assert f"reusing {tmp_path / 'run' / f'test_{method}_graded.jsonl'}: it grades these 2 trajectories" in p.stdout
    assert res["num_test_tasks"] == 2
    for method in ("zero_shot", "sweet_rl", "multi_turn_dpo", "rejection_ft"):
        assert method in table
        s = json.loads((tmp_path / "run" / f"test_{method}_summary.json").read_text())
        assert s["num_trajectories"] == 2
        m = res["methods"][method]
        assert m["success"] == s["success_rate"] and m["ci95"][0] <= m["success"] <= m["ci95"][1]
        assert m["tests_passed"] == pytest.approx(s["tests_passed"]) and (ROOT / m["policy"]).exists() or \
            os.path.exists(m["policy"])
        if method != "zero_shot":
            d = res["paired_vs_zero_shot"][method]
            assert d["ci95"][0] <= d["diff"] <= d["ci95"][1]
    # the three critics (SWEET, trajectory mean, no training info) and the untrained reference were scored
    assert set(res["credit_accuracy"]) == {"sweet", "trajectory_mean", "no_training_info", "untrained"}
    assert res["credit_accuracy"]["untrained"] in (None, 0.5)
    report = json.loads((tmp_path / "run" / "pairs.jsonl.credit.json").read_text())  # every DPO pair judged once
    n_pairs = len((tmp_path / "run" / "pairs.jsonl").read_text().splitlines())
    assert set(report["dpo_pairs"]) == {"right", "wrong", "same_class"} and sum(report["dpo_pairs"].values()) == n_pairs
    states = [json.loads(line) for line in (tmp_path / "run" / "pairs.jsonl.states.jsonl").read_text().splitlines()]
    assert res.get("credit_kind_order") == report["kind_order"] == credit.kind_order(states)  # the state-blind baseline
    trajs = {(t["task_id"], t.get("sample", 0)): t for t in colbench.load_graded(tmp_path / "run" / "train_graded.jsonl")}
    for st in states:  # told_all: whether the human had said every hidden fact before the state's turn
        traj = trajs[(st["task_id"], st["sample"])]
        assert st["told_all"] == colbench.knows_every_fact(traj["task"], credit.state_dialogue(traj, st["turn"]))
    assert report["answer_over_asking"]["sweet"] == credit.answer_over_asking(states, "sweet")
    assert json.loads((tmp_path / "run" / "critic" / "run_settings.json").read_text())["pair_facts"] is False  # code
    for critic, terms in (("critic", True), ("critic_no_training_info", True), ("critic_trajectory_mean", False)):
        # DECISION_TERMS=1: every per-turn critic scores each turn's first line as a term of its own; one mean has none
        assert json.loads((tmp_path / "run" / critic / "run_settings.json").read_text())["decision_terms"] is terms, critic
    assert json.loads((tmp_path / "run" / "pairs.jsonl.run_settings.json").read_text())["cross_kind"] == "turn"  # the paper's
    # credit.py --critics: the stored candidates scored anew; the same critic gives the same accuracy
    run = tmp_path / "run"
    subprocess.run([sys.executable, "credit.py", "--pairs", run / "pairs.jsonl", "--trajectories", run / "train_graded.jsonl",
                    "--critics", f"again={run / 'critic'},no_info={run / 'critic_no_training_info'}"], cwd=ROOT, check=True)
    again = json.loads((run / "pairs.jsonl.credit_rescored.json").read_text())
    # the states, with the new critics' advantages
    rescored = [json.loads(line) for line in (run / "pairs.jsonl.states_rescored.jsonl").read_text().splitlines()]
    assert len(rescored) == len([s for s in states if s.get("classes")])
    assert all(r["advantages_by_critic"]["again"] == pytest.approx(s["advantages_by_critic"]["sweet"], abs=1e-4)
               for r, s in zip(rescored, (s for s in states if s.get("classes"))))
    for new, old in (("again", "sweet"), ("no_info", "no_training_info")):
        assert again["class_pairs"][new] == report["class_pairs"][old]
        assert again["credit_accuracy"][new] == report["credit_accuracy"][old] or \
            again["credit_accuracy"][new] == pytest.approx(report["credit_accuracy"][old])
    assert "run directory" in p.stdout and "N_TEST=2" in p.stdout  # the settings in use are printed
    train = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert train["num_trajectories"] == 6 and train["success_rate"] >= 0.5  # the oracle's half succeeds
    # a rerun finds everything done and redoes nothing; asked for more free disk than there is, it warns first
    assert "GB free on the disk of" not in p.stderr  # a model other than the embedded one: no disk check by default
    p2 = subprocess.run(["bash", str(ROOT / "run.sh")], cwd=ROOT, env={**env, "FREE_GB": "100000000"}, capture_output=True,
                        text=True, timeout=900)
    assert p2.returncode == 0 and "0 to run" in p2.stderr
    assert f"GB free on the disk of {tmp_path / 'run'}, under FREE_GB=100000000;" in p2.stderr


def test_run_sh_html_loop(tiny_model, tmp_path):
    """The frontend loop on procedural pages with hidden design facts: oracle dialogues (exact designs)
    against the tiny model's give critic pairs; html turn classes, selection by similarity and results.json.
    The warm-up SFT trains in WARMUP_DTYPE (html: auto, fp32 here), the critics and DPO in TRAIN_DTYPE (html:
    bf16 where the CPU has bf16 instructions); an empty WARM_BAND skips the warm-up's calibration. CRITICS=2: two
    critics of each kind (seeds SEED and SEED+1000: 0 and 1000), the candidates ranked by their mean advantage.
    html's default PAIR_FACTS=1: the critics' pairs ranked by the design facts evaluate.py counts, then similarity;
    its LABEL_CROSS_KIND=decision: labelling ranks a candidate's first line before the whole turn, and its
    DECISION_TERMS=1: the critics train that first line as a term of its own. CRITIC_CONTRAST=1:
    a hasty and a stalling oracle dialogue per train page join the critics' pairs, never the labelled states."""
    env = {**os.environ, "SETUP": "0", "PY": sys.executable, "RUN": str(tmp_path / "run"), "MODEL": tiny_model,
           "TASK_TYPE": "html", "WARMUP": "1", "N_WARMUP": "2", "WARM_BAND": "", "N_TRAIN": "2", "N_TEST": "2",
           "SAMPLES": "1", "ORACLE_SAMPLES": "1",
           "CANDIDATES": "2", "PAIRS_PER_STATE": "1", "DATA_FRACTION": "1.0", "MAX_TURNS": "4", "MAX_NEW_TOKENS": "8",
           "LR_CRITIC": "1e-3", "LR_DPO": "1e-3", "CRITIC_EPOCHS": "1", "OMP_NUM_THREADS": "1", "N_VAL": "2", "VAL_SAMPLES": "1",
           "CRITICS": "2", "SCORE_DTYPE": "auto", "CRITIC_CONTRAST": "1"}  # fp32 scoring, as credit.py's below
    p = subprocess.run(["bash", str(ROOT / "run.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    table = (tmp_path / "run" / "results.txt").read_text()
    assert "similarity: pixel_hist_v1" in table and "sweet_rl" in table and "win rate" in table
    s = json.loads((tmp_path / "run" / "test_sweet_rl_summary.json").read_text())
    assert s["metric"] == "pixel_hist_v1" and 0 <= s["win_rate"] <= 1 and "exact_design" in s
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["metric"] == "pixel_hist_v1" and res["num_test_tasks"] == 2
    m, p_ = res["methods"]["sweet_rl"], res["paired_vs_zero_shot"]["sweet_rl"]
    assert m["ci95"][0] <= m["similarity"] <= m["ci95"][1] and m["similarity"] == pytest.approx(s["similarity"])
    assert p_["win_rate"] == pytest.approx(s["win_rate"]) and p_["win_rate_ci95"][0] <= p_["win_rate"] <= p_["win_rate_ci95"][1]
    # each ensemble beside its members, and the untrained reference
    assert set(res["credit_accuracy"]) == {"sweet", "sweet/1", "sweet/2", "no_training_info", "no_training_info/1",
                                           "no_training_info/2", "untrained"}
    for critic, seed in (("critic", 0), ("critic_2", 1000), ("critic_no_training_info", 0), ("critic_no_training_info_2", 1000)):
        settings = json.loads((tmp_path / "run" / critic / "run_settings.json").read_text())
        assert settings["group_by_task"] is True and settings["seed"] == seed  # html's critics score a trajectory once a step
        assert settings["pair_facts"] is True  # html's default: pairs by design facts right, then similarity
        assert settings["decision_terms"] is True  # html's default: each turn's first line a term of its own
        assert settings["extra_trajectories"] == str(tmp_path / "run" / "critic_contrast_graded.jsonl")
    contrast = read(tmp_path / "run" / "critic_contrast_graded.jsonl")  # after the policy's sample 0 and the oracle's 1
    assert sorted((r["task_id"], r["sample"]) for r in contrast) == sorted((t, s) for t in {r["task_id"] for r in contrast} for s in (2, 3))
    stalled = [r for r in contrast if r["sample"] == 3]
    assert len(stalled) == 2 and all(r["num_turns"] == 4 for r in stalled)
    assert not any(colbench.ANSWER_MARKER in m["content"] for r in stalled for m in r["dialogue_history"] if m["role"] == "assistant")
    states = read(tmp_path / "run" / "pairs.jsonl.states.jsonl")  # every labelled state has its true classes
    assert states and all(set(st["classes"]) <= {"good", "bad"} for st in states)
    assert all(st["sample"] <= 1 for st in states)  # the policy's and the complete oracle's dialogues, no contrast
    for st in states:  # the pairs were ranked by the two critics' mean advantage, first lines first (html's default)
        by, dec = st["advantages_by_critic"], st["decisions_by_critic"]
        assert st["advantages"] == by["sweet"] == pytest.approx([(a + b) / 2 for a, b in zip(by["sweet/1"], by["sweet/2"])])
        assert st["decisions"] == dec["sweet"] == pytest.approx([(a + b) / 2 for a, b in zip(dec["sweet/1"], dec["sweet/2"])])
        for c, d, a in zip(st["candidates"], dec["sweet/1"], by["sweet/1"]):
            assert "\n" in c.strip() or d == pytest.approx(a, abs=1e-6)  # a one-line turn is all decision
    assert json.loads((tmp_path / "run" / "pairs.jsonl.run_settings.json").read_text())["cross_kind"] == "decision"
    keys = {(st["task_id"], st["sample"], st["turn"], c): k for st in states
            for c, k in zip(st["candidates"], credit.rank_keys(st, "sweet"))}
    pairs = read(tmp_path / "run" / "pairs.jsonl")
    assert pairs and all(keys[(q["task_id"], q["sample"], q["turn"], q["chosen"])] >
                         keys[(q["task_id"], q["sample"], q["turn"], q["rejected"])] for q in pairs)
    # credit.py --critics takes an ensemble as DIR+DIR and scores the stored candidates as label_turns did
    run = tmp_path / "run"
    subprocess.run([sys.executable, "credit.py", "--pairs", run / "pairs.jsonl", "--trajectories", run / "train_graded.jsonl",
                    "--critics", f"both={run / 'critic'}+{run / 'critic_2'}"], cwd=ROOT, check=True)
    again, report = (json.loads((run / f"pairs.jsonl.{f}.json").read_text()) for f in ("credit_rescored", "credit"))
    assert again["class_pairs"]["both"] == report["class_pairs"]["sweet"] > 0
    assert again["credit_accuracy"]["both"] == pytest.approx(report["credit_accuracy"]["sweet"])
    assert set(report["by_kind"]) == {"sweet", "no_training_info"} and set(again["by_kind"]) == {"both"}  # not per member
    assert set(again["credit_accuracy"]) == {"both", "both/1", "both/2", "untrained"}
    assert res.get("credit_kind_order") == credit.kind_order(states)  # the state-blind baseline, beside the critics
    sel = json.loads((tmp_path / "run" / "select_sweet.json").read_text())
    assert "similarity" in sel["methods"]["start"] and res["methods"]["sweet_rl"]["policy"] == sel["selected_policy"]
    train = read(tmp_path / "run" / "train_graded.jsonl")
    oracle = [r for r in train if r["sample"] == 1]
    assert all(r["exact_design"] and r["reward"] == 1.0 for r in oracle) and min(r["reward"] for r in train) < 0.9
    assert all(r["facts_right"] == len(colbench.design_of(r["task"])) for r in oracle)
    assert (tmp_path / "run" / "critic" / "config.json").exists() and (tmp_path / "run" / "results.png").exists()
    assert (tmp_path / "run" / "report.html").exists()
    dpo = json.loads((tmp_path / "run" / "policy_sweet" / "run_settings.json").read_text())
    assert dpo["epochs"] == 0.67 and dpo["snapshots"] == 1  # html's update: 2/3 of a pass, one snapshot
    bf16_cpu = any(f in open("/proc/cpuinfo").read() for f in ("avx512_bf16", "amx_bf16"))
    assert json.loads((tmp_path / "run" / "policy_warm" / "run_settings.json").read_text())["dtype"] == "auto"
    for stage in ("critic", "critic_no_training_info", "policy_sweet"):
        assert json.loads((tmp_path / "run" / stage / "run_settings.json").read_text())["dtype"] == \
            ("bfloat16" if bf16_cpu else "auto"), stage
    assert "  WARM_BAND=\n" in p.stdout and "starting policy (oracle_hasty" not in p.stdout  # no calibration
    assert res["methods"]["zero_shot"]["policy"].endswith("policy_warm")


def read(path):
    return [json.loads(l) for l in open(path)]


def test_run_sh_on_colbench_files_uses_released_settings(tiny_model, tmp_path):
    """TRAIN_TASKS / TEST_TASKS: ColBench-format files replace the procedural tasks, and the settings
    not given take the released values. PROMPT_DIR: both the agent and the scripted human use its templates.
    The at-scale shape, on 2 CPU processes: a non-embedded MODEL with NPROC=2 samples rollouts and
    candidates in torchrun shards that run.sh merges, and trains with activation checkpointing under FSDP2."""
    from test_prompts import AGENT, write_templates
    tasks = [{"problem_description": f"Write add{i}(x). The signature is def add{i}(x)", "hidden_information": f"Add {i}.",
              "ground_truth": f"def add{i}(x):\n    return x + {i}\n", "test_cases": {"a": f"add{i}(1)", "b": f"add{i}(5)"}}
             for i in range(5)]
    for name, part in (("train.jsonl", tasks[:3]), ("test.jsonl", tasks[3:])):
        (tmp_path / name).write_text("".join(json.dumps(t) + "\n" for t in part))
    env = {**os.environ, "SETUP": "0", "PY": sys.executable, "RUN": str(tmp_path / "run"), "MODEL": tiny_model,
           "TRAIN_TASKS": str(tmp_path / "train.jsonl"), "TEST_TASKS": str(tmp_path / "test.jsonl"), "SAMPLES": "1",
           "ORACLE_SAMPLES": "1", "CANDIDATES": "2", "DATA_FRACTION": "1.0", "MAX_TURNS": "2", "MAX_NEW_TOKENS": "8",
           "CRITIC_EPOCHS": "1", "LR_CRITIC": "1e-3", "OMP_NUM_THREADS": "1", "NPROC": "2",
           "PROMPT_DIR": str(write_templates(tmp_path / "prompts"))}
    p = subprocess.run(["bash", str(ROOT / "run.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    for setting in ("TEMPERATURE=1.0", "TOP_P=1.0", "PAIRS_PER_STATE=4", "LR_DPO=2e-7", "WARMUP=0", "TRAIN_LAYERS=0",
                    "CREDIT_VARIANTS=0", "MAX_NEW_TOKENS=8", "CANDIDATES=2", "GRAD_CKPT=1"):  # released defaults; what is set wins
        assert f"  {setting}\n" in p.stdout, setting
    run = tmp_path / "run"
    for out in ("test_zero_shot.jsonl", "pairs.jsonl", "pairs.jsonl.states.jsonl"):  # the shards, merged in order
        shards = [run / f"{out.replace('.states.jsonl', '')}.shard-{i}-of-2{'.states.jsonl' if 'states' in out else ''}"
                  for i in range(2)]
        assert all(f.exists() for f in shards) and (run / out).read_text() == "".join(f.read_text() for f in shards), out
    assert len(read(run / "train_rollouts.jsonl")) == 6  # 3 tasks x (1 sample + 1 oracle)
    assert "grad_ckpt" in json.loads((run / "policy_sweet" / "run_settings.json").read_text()) and \
        json.loads((run / "critic" / "run_settings.json").read_text())["grad_ckpt"] is True
    assert [t["ground_truth"] for t in read(tmp_path / "run" / "train_tasks.jsonl")] == [t["ground_truth"] for t in tasks[:3]]
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["num_test_tasks"] == 2 and set(res["methods"]) == {"zero_shot", "sweet_rl"}
    assert not (tmp_path / "run" / "warmup_tasks.jsonl").exists()
    for r in read(tmp_path / "run" / "train_graded.jsonl"):
        assert AGENT in next(m["input"] for m in r["dialogue_history"] if m["role"] == "assistant")
        if r["sample"] > 0:  # the oracle's dialogues: the templated human revealed the fact it asked for
            assert r["task"]["hidden_information"] in " ".join(m["content"] for m in r["dialogue_history"] if m["role"] == "user")
