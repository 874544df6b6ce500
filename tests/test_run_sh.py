"""run.sh end to end on a tiny random model and a handful of tasks (every stage, baselines included)."""
import json
import os
import subprocess
import sys

import pytest

import credit
from conftest import ROOT


def read(path):
    return [json.loads(l) for l in open(path)]


def oracle_trajectories(tmp_path, task_type="code", n=3):
    """TRAIN_TRAJECTORIES for a tiny model that never succeeds: oracle dialogues, half of them hasty, so that
    most tasks have a success and a failure (critic pairs). Written by rollout.py against the scripted human."""
    tasks, out = tmp_path / f"traj_tasks_{task_type}.jsonl", tmp_path / f"traj_{task_type}.jsonl"
    sim = subprocess.Popen([sys.executable, "simulator.py", "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        url = next(line for line in sim.stdout if "ready at" in line).split("ready at ")[1].split("/v1")[0]
        run = lambda *a: subprocess.run([sys.executable, *map(str, a)], cwd=ROOT, check=True, capture_output=True)
        run("generate_tasks.py", "--task_type", task_type, "--num_tasks", n, "--seed", 50, "--output", tasks)
        run("rollout.py", "--task_type", task_type, "--tasks", tasks, "--output", out, "--agent_backend", "oracle",
            "--oracle_hasty", 0.5, "--samples", 3, "--simulator_url", url)
    finally:
        sim.kill()
    return out


def test_run_sh_end_to_end(tiny_model, tmp_path):
    env = {**os.environ, "PY": sys.executable, "RUN": str(tmp_path / "run"), "MODEL": tiny_model, "N_WARMUP": "0",
           "TRAIN_TRAJECTORIES": str(oracle_trajectories(tmp_path)), "N_TEST": "2", "N_VAL": "2", "CANDIDATES": "2",
           "DATA_FRACTION": "0.2", "MAX_NEW_TOKENS": "8", "BASELINES": "1", "LR_CRITIC": "1e-3", "LR_DPO": "1e-3", "LR_MTDPO": "2e-3",
           "LR_RFT": "3e-3", "NLL_MTDPO": "0.01", "MC_STATES": "1", "CRITIC_ARGS": "--ridge 0.5",
           "ABLATIONS": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", str(ROOT / "run.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    run = tmp_path / "run"
    table, res = (run / "results.txt").read_text(), json.loads((run / "results.json").read_text())
    # each update was selected on the 2 validation tasks (disjoint from test) against its start; the validation
    # tasks and the start's validation sit beside the run, shared by every draw of these settings
    start, = tmp_path.glob("start-*")
    val = {t["task_id"] for t in read(start / "val_tasks.jsonl")}
    assert len(val) == 2 and not val & {t["task_id"] for t in read(run / "test_tasks.jsonl")}
    assert (start / "val_start_graded.jsonl").exists() and not (run / "val_tasks.jsonl").exists()
    steps = -(-len(read(run / "pairs.jsonl")) // 8)  # every method: SWEET-RL's pass over its pairs, one grid
    for name, method in (("sweet", "sweet_rl"), ("mtdpo", "multi_turn_dpo"), ("rft", "rejection_ft")):
        sel = json.loads((run / f"select_{name}.json").read_text())
        grid = [f"{name}_step-{k}" for k in (round(steps / 3), round(2 * steps / 3)) if 0 < k < steps]
        assert list(sel["methods"]) == ["start", *dict.fromkeys(grid), f"{name}_end"]
        assert sel["methods"][f"{name}_end"]["training"]["steps"] == steps
        assert sel["methods"][f"{name}_end"]["training"]["step"] == steps
        assert sel["methods"][f"{name}_end"]["training"]["mode"] == {"sweet": "turn", "mtdpo": "trajectory"}.get(name, "sft")
        assert sel["methods"][f"{name}_end"]["training"]["lr"] == {"sweet": 1e-3, "mtdpo": 2e-3, "rft": 3e-3}[name]
        assert res["methods"][method]["policy"] == sel["selected_policy"]
    # the tiny model succeeds nowhere: every policy ties at 0 on validation, the start wins the tie, and an update
    # that kept its start reuses zero_shot's test dialogues instead of rolling them out again
    zero_shot = (run / "test_zero_shot.jsonl").read_bytes()
    for method in ("sweet_rl", "multi_turn_dpo", "rejection_ft"):
        assert res["methods"][method]["policy"] == tiny_model
        assert (run / f"test_{method}.jsonl").read_bytes() == zero_shot
        assert f"{method} is the starting policy: its test dialogues are zero_shot's" in p.stdout
    assert res["num_test_tasks"] == 2
    for method in ("zero_shot", "sweet_rl", "multi_turn_dpo", "rejection_ft"):
        assert method in table
        s = json.loads((run / f"test_{method}_summary.json").read_text())
        m = res["methods"][method]
        assert s["num_trajectories"] == 2 and m["success"] == s["success_rate"] and m["ci95"][0] <= m["success"] <= m["ci95"][1]
        for other in ("sweet_rl", "multi_turn_dpo", "rejection_ft"):  # every method against every other
            if other != method:
                d = res[f"paired_vs_{other}"][method]
                assert d["ci95"][0] <= d["diff"] <= d["ci95"][1]
    # the SWEET critic and the no-information ablation, scored on the same candidates, and the untrained reference
    assert set(res["credit_accuracy"]) == {"sweet", "no_training_info", "untrained"}
    report = json.loads((run / "pairs.jsonl.credit.json").read_text())  # every DPO pair judged once
    n_pairs = len((run / "pairs.jsonl").read_text().splitlines())
    assert set(report["dpo_pairs"]) == {"right", "wrong", "same_class"} and sum(report["dpo_pairs"].values()) == n_pairs
    states = credit.labelled_states(run / "pairs.jsonl")  # with credit.py's true classes (pairs.jsonl.classes.jsonl)
    assert states and report["kind_order"] == credit.kind_order(states)  # the class diagnostic's state-blind order
    # credit_accuracy: the candidates of a fixed sample of states valued by their continuations under the start
    mc = read(run / "pairs.jsonl.mc.jsonl")
    assert mc and {tuple(r["mc_state"]) for r in mc} <= {(s["task_id"], s["sample"], s["turn"]) for s in states}
    assert all(sum(r["mc_candidate"] == c and r["mc_state"] == st for r in mc) == (1 if ex else 16)
               for st, c, ex in {(tuple(r["mc_state"]), r["mc_candidate"], r["exact"]) for r in mc} for st in [list(st)])
    assert len(read(run / "pairs.jsonl.mc_graded.jsonl")) == len(mc)
    # procedural code tasks: the curriculum's budget of 4 agent turns, in rollouts, the turn classes and the values
    for f in ("test_zero_shot.jsonl", "pairs.jsonl.credit", "pairs.jsonl.mc_rollouts.jsonl"):
        assert json.loads((run / f"{f}.run_settings.json").read_text())["max_turns"] == 4, f
    assert res["credit_pairs"] == report["credit_pairs"] and res.get("credit_kind_order") == report["credit_kind_order"]
    # turn credit by kind of class pair, in results.json too, each critic named with the form that ranked
    assert res["by_kind"] == report["by_kind"] and res["kind_order"] == report["kind_order"]
    assert set(report["forms"]) == {"sweet", "no_training_info"} and "no training info" in report["forms"]["no_training_info"]
    assert report["forms"]["sweet"].startswith("ranking ") and f"  sweet ({report['forms']['sweet']}): " in table
    settings = json.loads((run / "critic" / "run_settings.json").read_text())
    assert settings["ridge"] == 0.5 and "ridge 0.5" in report["forms"]["no_training_info"]  # CRITIC_ARGS, both critics
    assert settings["epochs"] == 4 and settings["train_layers"] == 0 and settings["grad_ckpt"] is False  # a real model:
    assert settings["schedule"] == "released"  # the released recipe
    assert "run directory" in p.stdout and "  N_TEST=2\n" in p.stdout  # the settings in use are printed
    train = json.loads((run / "train_summary.json").read_text())
    assert train["num_trajectories"] == 9 and 0 < train["success_rate"] < 1  # the oracle's complete dialogues succeed
    assert not (run / "train_rollouts.jsonl").exists()  # trained from the given trajectories, no train rollouts
    assert (run / "report.html").exists()
    # a rerun finds everything done and redoes nothing
    p2 = subprocess.run(["bash", str(ROOT / "run.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p2.returncode == 0 and "0 to run" in p2.stderr and "reusing" in p2.stdout
    assert "Traceback" not in p2.stderr
    # a critic variant on the run's rollouts, trained as its critic was, scored on its candidates beside it
    p4 = subprocess.run(["bash", "bench/critic_variants.sh", str(run), "eq2=--ridge 0"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=900)
    assert p4.returncode == 0, p4.stdout[-4000:] + p4.stderr[-4000:]
    variant = json.loads((run / "critic_eq2" / "run_settings.json").read_text())
    assert variant["ridge"] == 0 and all(variant[k] == settings[k] for k in ("model", "lr", "epochs", "seed", "schedule"))
    assert "critic_eq2/ref_logprobs, 0 to compute" in p4.stdout  # pi_ref's log-probs the run's critic kept
    rescored = json.loads((run / "rescore" / "report.json").read_text())
    assert {"sweet/paper", "sweet/released", "eq2/paper", "eq2/released", "pmi"} <= set(rescored["exact_accuracy"])
    # how far an update moved from the start, on its own validation dialogues: 0 for the start itself
    kl = lambda pol: json.loads(subprocess.run(
        [sys.executable, "bench/policy_kl.py", "--policy", pol, "--start", tiny_model, "--trajectories",
         str(run / "val_sweet_end.jsonl")], cwd=ROOT, env=env, capture_output=True, text=True, check=True,
        timeout=300).stdout.splitlines()[-1])
    moved, still = kl(str(run / "policy_sweet")), kl(tiny_model)
    assert still["kl_per_turn"] == 0 and moved["kl_per_turn"] != 0 and moved["dialogues"] == 4  # 2 tasks x 2
    # the tuning procedure: the draw's stages up to the labels reused, every method trained and selected again at
    # another rate, never tested (N_TEST=0)
    p3 = subprocess.run(["bash", "bench/tune_lr.sh", str(run), "2e-3"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=900)
    assert p3.returncode == 0, p3.stdout[-4000:] + p3.stderr[-4000:]
    tuned = tmp_path / "run_lr2e-3"
    assert "reusing " + str(tuned / "critic") in p3.stdout and "0 to compute" in p3.stdout  # critic, pi_ref log-probs
    assert (tuned / "pairs.jsonl").read_bytes() == (run / "pairs.jsonl").read_bytes()
    for name in ("sweet", "mtdpo", "rft"):
        sel = json.loads((tuned / f"select_{name}.json").read_text())
        assert sel["methods"][f"{name}_end"]["training"]["lr"] == 2e-3
        assert sel["methods"][f"{name}_end"]["training"]["steps"] == steps
    assert not list(tuned.glob("test_sweet_rl*")) and not (tuned / "results.json").exists()
    table = p3.stdout[p3.stdout.index("(validation success of the kept policy)"):].splitlines()
    assert [line.split()[0] for line in table[1:4]] == ["1e-03", "2e-03", "3e-03"]  # each method at its run's rate
    assert [line.split()[1] for line in table[1:4]] == ["1", "0.01", "0.01"]  # the draw's SWEET-RL: run.sh's NLL
    assert len(table[1].split()) == 3 and len(table[2].split()) == 5 and len(table[3].split()) == 3
    # the grid's other NLL weight, SWEET-RL alone: its own directory, its row beside the paper's weight's
    p5 = subprocess.run(["bash", "bench/tune_lr.sh", str(run), "2e-3"], cwd=ROOT, env={**env, "NLL": "1",
                        "BASELINES": "0"}, capture_output=True, text=True, timeout=900)
    assert p5.returncode == 0, p5.stdout[-4000:] + p5.stderr[-4000:]
    sel = json.loads((tmp_path / "run_lr2e-3_nll1" / "select_sweet.json").read_text())
    assert sel["methods"]["sweet_end"]["training"]["nll_coef"] == 1 and "  NLL_DPO=1\n" in p5.stdout
    assert not (tmp_path / "run_lr2e-3_nll1" / "select_mtdpo.json").exists()
    table = p5.stdout[p5.stdout.index("(validation success of the kept policy)"):].splitlines()
    assert [line.split()[:2] for line in table[1:5]] == [["1e-03", "1"], ["2e-03", "0.01"], ["2e-03", "1"],
                                                         ["3e-03", "0.01"]] and len(table[3].split()) == 3
    # and its baselines: multi-turn DPO trained at the other weight, RFT (no NLL term) the paper's weight's cell
    p6 = subprocess.run(["bash", "bench/tune_lr.sh", str(run), "2e-3"], cwd=ROOT, env={**env, "NLL": "1"},
                        capture_output=True, text=True, timeout=900)
    assert p6.returncode == 0, p6.stdout[-4000:] + p6.stderr[-4000:]
    nll1 = tmp_path / "run_lr2e-3_nll1"
    sel = json.loads((nll1 / "select_mtdpo.json").read_text())
    assert sel["methods"]["mtdpo_end"]["training"]["nll_coef"] == 1 and "  NLL_MTDPO=1\n" in p6.stdout
    assert (nll1 / "policy_rft").resolve() == (tuned / "policy_rft").resolve() and f"reusing {nll1}/policy_rft" in p6.stdout
    rft = [{k: v["success"] for k, v in json.loads((d / "select_rft.json").read_text())["methods"].items()}
           for d in (nll1, tuned)]
    assert rft[0] == rft[1] and "reusing " + str(nll1 / "val_rft_end_graded.jsonl") in p6.stdout  # graded once
    table = p6.stdout[p6.stdout.index("(validation success of the kept policy)"):].splitlines()
    assert table[3].split()[:2] == ["2e-03", "1"] and len(table[3].split()) == 4  # SWEET-RL, multi-turn DPO


def test_run_sh_html_loop(tiny_model, tmp_path):
    """The frontend loop on procedural pages with hidden design facts: the warm-up with its calibration (the tiny
    model's start misses the band, so the warm-up is redone twice with fewer hasty dialogues), oracle dialogues
    (exact designs) as train trajectories, html turn classes, selection by exact designs and results.json."""
    env = {**os.environ, "PY": sys.executable, "RUN": str(tmp_path / "run"), "MODEL": tiny_model, "TASK_TYPE": "html",
           "N_WARMUP": "2", "TRAIN_TRAJECTORIES": str(oracle_trajectories(tmp_path, "html", 2)), "N_TEST": "2", "N_VAL": "2",
           "CANDIDATES": "2", "DATA_FRACTION": "0.2", "MAX_NEW_TOKENS": "8", "LR_CRITIC": "1e-3", "LR_DPO": "1e-3",
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", str(ROOT / "run.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    run = tmp_path / "run"
    assert "starting policy (oracle_hasty 0.15): validation success 0.0, band [0.25,0.55]: outside" in p.stdout
    start, = tmp_path.glob("start-*")  # the start is built beside the run, for every draw of these settings
    assert (start / "policy_warm_hasty0.05" / "config.json").exists() and "after 2 retries" in p.stderr
    assert not list(run.glob("policy_warm*")) and not list(run.glob("warmup*"))
    table = (run / "results.txt").read_text()
    assert "similarity: pixel_hist_v1" in table and "sweet_rl" in table and "win rate" in table
    s = json.loads((run / "test_sweet_rl_summary.json").read_text())
    assert s["metric"] == "pixel_hist_v1" and 0 <= s["win_rate"] <= 1 and "exact_design" in s
    res = json.loads((run / "results.json").read_text())
    assert res["metric"] == "pixel_hist_v1" and res["num_test_tasks"] == 2
    m, p_ = res["methods"]["sweet_rl"], res["paired_vs_zero_shot"]["sweet_rl"]
    assert m["ci95"][0] <= m["similarity"] <= m["ci95"][1] and m["similarity"] == pytest.approx(s["similarity"])
    assert p_["win_rate"] == pytest.approx(s["win_rate"]) and p_["win_rate_ci95"][0] <= p_["win_rate"] <= p_["win_rate_ci95"][1]
    # without ABLATIONS=1: no no-information critic, no Monte-Carlo values; pages have no exact answer pairs
    assert set(res["class_accuracy"]) == {"sweet", "untrained"} and not (run / "critic_no_training_info").exists()
    assert "credit_accuracy" not in res and not (run / "pairs.jsonl.mc.jsonl").exists()
    states = credit.labelled_states(run / "pairs.jsonl")  # every labelled state has its true classes (credit.py)
    assert states and all(set(st["classes"]) <= {"good", "bad"} for st in states)
    sel = json.loads((run / "select_sweet.json").read_text())  # selected by success (exact designs), as on code
    assert "similarity" in sel["methods"]["start"] and m["policy"] == sel["selected_policy"]
    assert sel["selected_by"] == "exact_design"
    train = read(run / "train_graded.jsonl")  # the reward: the share of the five design facts right
    assert any(r["exact_design"] and r["reward"] == 1.0 for r in train) and min(r["reward"] for r in train) < 0.9
    assert {round(5 * r["reward"], 6) for r in train} <= {0, 1, 2, 3, 4, 5} and all(0 < r["similarity"] for r in train)
    assert res["methods"]["zero_shot"]["policy"].endswith("policy_warm_hasty0")
    # an html tuning draw: bench/tune_lr.sh takes the draw's task type from its settings, not from the environment
    env.pop("TASK_TYPE")
    p2 = subprocess.run(["bash", "bench/tune_lr.sh", str(run), "2e-3"], cwd=ROOT, env={**env, "BASELINES": "0"},
                        capture_output=True, text=True, timeout=900)
    assert p2.returncode == 0, p2.stdout[-4000:] + p2.stderr[-4000:]
    cell = tmp_path / "run_lr2e-3"
    assert "  TASK_TYPE=html\n" in p2.stdout and "reusing " + str(cell / "critic") in p2.stdout
    sel = json.loads((cell / "select_sweet.json").read_text())
    assert sel["methods"]["sweet_end"]["training"]["lr"] == 2e-3 and "similarity" in sel["methods"]["sweet_end"]
    assert json.loads((cell / "policy_sweet" / "run_settings.json").read_text())["task_type"] == "html"
    table = p2.stdout[p2.stdout.index("(validation exact design of the kept policy)"):].splitlines()  # pages: success
    assert table[2].split()[:3] == ["2e-03", "0.01", f"{100 * sel['methods'][sel['selected']]['exact_design']:.1f}%"]


def test_run_sh_on_colbench_files_uses_released_settings(tiny_model, tmp_path):
    """TRAIN_TASKS / TEST_TASKS: ColBench-format files replace the procedural tasks, and the settings not given take
    the released values (config/colbench.sh): every train task, the first N_TEST test tasks. PROMPT_DIR: both the
    agent and the scripted human use its templates. The at-scale shape, on 2 CPU processes: a non-embedded MODEL
    with NPROC=2 samples rollouts and candidates in torchrun shards that run.sh merges, and trains under FSDP2
    (activation checkpointing only where a GPU's memory needs it: never here)."""
    from test_prompts import AGENT, write_templates
    tasks = [{"problem_description": f"Write add{i}(x). The signature is def add{i}(x)", "hidden_information": f"Add {i}.",
              "ground_truth": f"def add{i}(x):\n    return x + {i}\n", "test_cases": {"a": f"add{i}(1)", "b": f"add{i}(5)"}}
             for i in range(110)]
    for name, part in (("train.jsonl", tasks[:104]), ("test.jsonl", tasks[104:])):
        (tmp_path / name).write_text("".join(json.dumps(t) + "\n" for t in part))
    prompts = write_templates(tmp_path / "prompts")
    trajectories = tmp_path / "traj.jsonl"  # oracle dialogues of 3 train tasks, in the templates' format
    (tmp_path / "few.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks[:3]))
    sim = subprocess.Popen([sys.executable, "simulator.py", "--port", "0", "--prompt_dir", prompts], cwd=ROOT,
                           stdout=subprocess.PIPE, text=True)
    try:
        url = next(line for line in sim.stdout if "ready at" in line).split("ready at ")[1].split("/v1")[0]
        subprocess.run([sys.executable, "rollout.py", "--tasks", tmp_path / "few.jsonl", "--output", trajectories,
                        "--agent_backend", "oracle", "--oracle_hasty", "0.5", "--samples", "6", "--simulator_url", url,
                        "--prompt_dir", prompts], cwd=ROOT, check=True, capture_output=True)
    finally:
        sim.kill()
    env = {**os.environ, "PY": sys.executable, "RUN": str(tmp_path / "run"), "MODEL": tiny_model, "N_TEST": "4",
           "TRAIN_TASKS": str(tmp_path / "train.jsonl"), "TEST_TASKS": str(tmp_path / "test.jsonl"), "CANDIDATES": "2",
           "DATA_FRACTION": "0.3", "MAX_NEW_TOKENS": "8", "LR_CRITIC": "1e-3", "OMP_NUM_THREADS": "1", "NPROC": "2", "MC_STATES": "0",
           "PROMPT_DIR": str(prompts), "TRAIN_TRAJECTORIES": str(trajectories)}
    p = subprocess.run(["bash", str(ROOT / "run.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    for setting in ("N_VAL=0", "N_WARMUP=0", "SAMPLES=3", "LR_DPO=2e-7", "NLL_DPO=0.01", "NLL_MTDPO=0.01", "LR_MTDPO=2e-7",
                    "LR_RFT=2e-7", "MAX_NEW_TOKENS=8", "N_TEST=4"):  # what is set wins (at scale: the released recipe, the paper's NLL weight)
        assert f"  {setting}\n" in p.stdout, setting
    run = tmp_path / "run"
    assert len(read(run / "train_tasks.jsonl")) == 104 and len(read(run / "test_tasks.jsonl")) == 4  # whole file; first N_TEST
    for out in ("test_zero_shot.jsonl", "pairs.jsonl", "pairs.jsonl.states.jsonl"):  # the shards, merged in order
        shards = [run / f"{out.replace('.states.jsonl', '')}.shard-{i}-of-2{'.states.jsonl' if 'states' in out else ''}"
                  for i in range(2)]
        assert all(f.exists() for f in shards) and (run / out).read_text() == "".join(f.read_text() for f in shards), out
    assert json.loads((run / "policy_sweet" / "run_settings.json").read_text())["grad_ckpt"] is False  # (only where memory needs it)
    assert json.loads((run / "test_zero_shot.jsonl.shard-0-of-2.run_settings.json").read_text())["max_turns"] == 10  # ColBench's
    res = json.loads((run / "results.json").read_text())
    assert res["num_test_tasks"] == 4 and set(res["methods"]) == {"zero_shot", "sweet_rl"}
    assert not (run / "warmup_tasks.jsonl").exists() and not (run / "critic_no_training_info").exists()
    for r in read(run / "train_graded.jsonl"):
        assert AGENT in next(m["input"] for m in r["dialogue_history"] if m["role"] == "assistant")
