"""run.sh end to end on a tiny random model and a handful of tasks (every stage, baselines included)."""
import json
import os
import subprocess
import sys

from conftest import ROOT


def test_run_sh_end_to_end(tiny_model, tmp_path):
    env = {**os.environ, "SETUP": "0", "PY": sys.executable, "RUN": str(tmp_path / "run"), "MODEL": tiny_model,
           "WARMUP": "0", "N_TRAIN": "3", "N_TEST": "2", "SAMPLES": "1", "ORACLE_SAMPLES": "1", "CANDIDATES": "2",
           "PAIRS_PER_STATE": "2", "DATA_FRACTION": "1.0", "MAX_TURNS": "2", "MAX_NEW_TOKENS": "8", "BASELINES": "1",
           "LR_CRITIC": "1e-3", "LR_DPO": "1e-3", "CRITIC_EPOCHS": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", str(ROOT / "run.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    table = (tmp_path / "run" / "results.txt").read_text()
    for method in ("zero_shot", "sweet_rl", "multi_turn_dpo", "rejection_ft"):
        assert method in table
        s = json.loads((tmp_path / "run" / f"test_{method}_summary.json").read_text())
        assert s["num_trajectories"] == 2
    train = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert train["num_trajectories"] == 6 and train["success_rate"] >= 0.5  # the oracle's half succeeds
    # a rerun finds everything done and redoes nothing
    p2 = subprocess.run(["bash", str(ROOT / "run.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p2.returncode == 0 and "0 to run" in p2.stderr
