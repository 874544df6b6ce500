"""Mixed precision (--dtype bfloat16): the optimizer updates fp32 master weights, so the paper's
2e-7 step is not rounded away, in one process (autocast) and under torchrun (FSDP2 MixedPrecisionPolicy)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from machinery import models
from conftest import build_tiny_model, read_jsonl
from test_fsdp import launch
from test_training import write_graded


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """The tiny model with bf16-representable weights, as a released bf16 checkpoint has: a 2e-7 step on a
    bf16 weight rounds back to it, so only fp32 master weights can move."""
    d = build_tiny_model(tmp_path_factory.mktemp("bf16_model"))
    model = AutoModelForCausalLM.from_pretrained(d)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(d)
    tok = models.load_tokenizer(d)
    write_graded(tok, tmp_path_factory.getbasetemp() / "bf16_graded.jsonl", n_tasks=4)
    return d, tmp_path_factory.getbasetemp() / "bf16_graded.jsonl"


def changed_share(start, out, dtype=None):
    """Share of the elements of every weight matrix that differ from the start (the embedding aside: its
    rows of tokens absent from the data get no gradient)."""
    a = dict(AutoModelForCausalLM.from_pretrained(start).named_parameters())
    b = dict(AutoModelForCausalLM.from_pretrained(out, dtype=dtype).named_parameters()) if dtype else \
        dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    keys = [k for k in a if a[k].dim() == 2 and "embed_tokens" not in k]
    return sum((a[k] != b[k].float()).sum().item() for k in keys) / sum(a[k].numel() for k in keys)


def dpo(n, model, graded, out, *extra):
    launch(n, "train_dpo.py", "--mode", "trajectory", "--trajectories", graded, "--model", model, "--output_dir", out,
           "--lr", "2e-7", "--batch_size", "4", "--epochs", "2", *extra)  # 4 pairs: 2 steps
    return read_jsonl(out / "log.jsonl")


def test_bf16_dpo_at_2e_7_changes_the_weights(bf16_checkpoint, tmp_path):
    model, graded = bf16_checkpoint
    log = dpo(1, model, graded, tmp_path / "bf16", "--dtype", "bfloat16")
    assert len(log) == 2
    assert changed_share(model, tmp_path / "bf16") > 0.9  # fp32 master weights: every trained weight moved
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.float32  # saved as trained
    # fp32 compute: the same losses within bf16's precision
    fp32 = dpo(1, model, graded, tmp_path / "fp32", "--dtype", "float32")
    assert [r["loss"] for r in log] == pytest.approx([r["loss"] for r in fp32], abs=2e-3)
    assert [r["grad_norm"] for r in log] == pytest.approx([r["grad_norm"] for r in fp32], rel=0.05)
    # --save_dtype bfloat16 (for serving) keeps half the bytes and, as the README says, loses updates
    # smaller than half a bf16 step: here nearly all of them
    dpo(1, model, graded, tmp_path / "served", "--dtype", "bfloat16", "--save_dtype", "bfloat16")
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "served", dtype="auto")
    assert served.dtype == torch.bfloat16 and changed_share(model, tmp_path / "served", torch.bfloat16) < 0.05


def test_bf16_under_torchrun_two_processes(bf16_checkpoint, tmp_path):
    """FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on 2 CPU processes (gloo):
    the fp32 shards move, and the losses match one process in bf16."""
    model, graded = bf16_checkpoint
    two = dpo(2, model, graded, tmp_path / "two", "--dtype", "bfloat16")
    one = dpo(1, model, graded, tmp_path / "one", "--dtype", "bfloat16")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], abs=2e-3)
    assert changed_share(model, tmp_path / "two") > 0.9
    critic = tmp_path / "critic"
    launch(2, "train_critic.py", "--trajectories", graded, "--model", model, "--output_dir", critic, "--lr", "2e-7",
           "--batch_size", "4", "--heldout_fraction", "0", "--dtype", "bfloat16")
    assert changed_share(model, critic) > 0.9
