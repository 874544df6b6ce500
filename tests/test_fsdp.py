"""FSDP2 under torchrun with two CPU processes (gloo) matches one process on the same global batch."""
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import common
from conftest import ROOT, read_jsonl
from test_training import write_graded


def launch(nproc, script, *args):
    cmd = [sys.executable, str(ROOT / script), *map(str, args)] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(ROOT / script), *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.parametrize("script,extra", [
    ("train_critic.py", ["--epochs", "2", "--heldout_fraction", "0"]),
    ("train_dpo.py", ["--mode", "trajectory", "--epochs", "2"]),
])
def test_two_processes_match_one(tiny_model, tmp_path, script, extra):
    tok = common.load_tokenizer(tiny_model)
    write_graded(tok, tmp_path / "g.jsonl", n_tasks=4)
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"out{n}"
        launch(n, script, "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model, "--output_dir", out,
               "--lr", "1e-3", "--batch_size", "4", *extra)
        runs[n] = (read_jsonl(out / "log.jsonl"), out)
    (log1, out1), (log2, out2) = runs[1], runs[2]
    assert len(log1) == len(log2) == 2
    for a, b in zip(log1, log2):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    assert log1[1]["loss"] != pytest.approx(log1[0]["loss"], abs=1e-6)  # the optimizer steps did change the model
    ids = torch.tensor([tok("I WANT TO ANSWER: def f(x): return x * 2")["input_ids"]])
    m1, m2 = (AutoModelForCausalLM.from_pretrained(o).eval() for o in (out1, out2))
    with torch.no_grad():
        l1, l2 = m1(ids).logits, m2(ids).logits
    assert torch.allclose(l1, l2, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.no_grad():
        assert not torch.allclose(base(ids).logits, l2, atol=1e-4)  # the FSDP checkpoint holds the trained weights
