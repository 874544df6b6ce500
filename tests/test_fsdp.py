"""FSDP2 under torchrun with two CPU processes (gloo) matches one process on the same global batch."""
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from machinery import models
from conftest import ROOT, build_tiny_model, read_jsonl, saved_step
from test_training import write_graded


def launch(nproc, script, *args, timeout=600):
    cmd = [sys.executable, str(ROOT / script), *map(str, args)] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(ROOT / script), *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def kill_tree(pid):
    """SIGKILL a process and all its descendants, children first found from /proc."""
    import signal
    children = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    todo, found = [pid], []
    while todo:
        q = todo.pop()
        found.append(q)
        todo += children.get(q, [])
    for q in found:
        try:
            os.kill(q, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("script,extra", [  # the whole critic: test_ranks_with_uneven_work_stay_in_lock_step
    # the top layer alone, with the ridge
    ("train_critic.py", ["--epochs", "2", "--heldout_fraction", "0", "--train_layers", "1", "--ridge", "1"]),
    ("train_dpo.py", ["--mode", "trajectory", "--epochs", "2"]),
])
def test_two_processes_match_one(tiny_model, tmp_path, script, extra):
    tok = models.load_tokenizer(tiny_model)
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


def test_ranks_with_uneven_work_stay_in_lock_step(tiny_model, tmp_path):
    """3 tasks on 2 ranks: one rank has a task (a pair, one forward) where the other has none, in the reference log-probs and in the step. Every rank pads its forwards to the
    plan all ranks compute alike (training.lockstep_plan), so none waits in a collective the others never
    reach (this hung before), and the run matches one process."""
    tok = models.load_tokenizer(tiny_model)
    write_graded(tok, tmp_path / "g.jsonl", n_tasks=3)
    logs = []
    for n in (1, 2):
        launch(n, "train_critic.py", "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model, "--output_dir",
               tmp_path / f"out{n}", "--lr", "1e-3", "--batch_size", "4", "--epochs", "2", "--heldout_fraction", "0",
               timeout=180)
        logs.append(read_jsonl(tmp_path / f"out{n}" / "log.jsonl"))
    assert len(logs[0]) == len(logs[1]) == 2
    assert [r["loss"] for r in logs[1]] == pytest.approx([r["loss"] for r in logs[0]], abs=1e-5)


def test_shared_prompt_dpo_two_processes_match_one(tiny_model, tmp_path):
    """Turn-level DPO with the prompt run once per pair (a KV cache under FSDP2) matches one process."""
    import json
    import colbench
    tok = models.load_tokenizer(tiny_model)
    pairs = []
    for i in range(4):
        prompt = models.render_prompt(tok, colbench.agent_messages({}, [{"role": "user", "content": f"Write f{i}(x)."}]))
        pairs.append({"prompt": prompt, "chosen": f"What should f{i} return?", "rejected": f"I WANT TO ANSWER: def f{i}(x): return {i}"})
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    logs = []
    for n in (1, 2):
        launch(n, "train_dpo.py", "--pairs", tmp_path / "pairs.jsonl", "--model", tiny_model, "--output_dir",
               tmp_path / f"out{n}", "--lr", "1e-3", "--batch_size", "2", "--epochs", "2")
        logs.append(read_jsonl(tmp_path / f"out{n}" / "log.jsonl"))
    assert len(logs[0]) == len(logs[1]) == 4
    assert [r["loss"] for r in logs[1]] == pytest.approx([r["loss"] for r in logs[0]], abs=1e-5)
    assert logs[0][-1]["loss"] != pytest.approx(logs[0][0]["loss"], abs=1e-6)


def test_two_processes_killed_and_resumed_match_one_uninterrupted(tiny_model, tmp_path):
    """The resume state is written shard by shard under FSDP2; a torchrun killed with SIGKILL and
    relaunched with --resume ends where one uninterrupted process does."""
    import time
    tok = models.load_tokenizer(tiny_model)
    write_graded(tok, tmp_path / "g.jsonl", n_tasks=8)
    args = lambda out: ["--mode", "trajectory", "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model,
                        "--output_dir", out, "--lr", "1e-3", "--batch_size", "2", "--epochs", "2", "--save_minutes", "0"]
    launch(1, "train_dpo.py", *args(tmp_path / "one"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train_dpo.py"), *map(str, args(tmp_path / "two"))]
    p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while saved_step(tmp_path / "two" / "resume") < 2:
        assert p.poll() is None and time.time() - t0 < 300
        time.sleep(0.01)
    kill_tree(p.pid)  # torchrun and its workers (they may sit in sessions of their own)
    p.wait()
    assert len(read_jsonl(tmp_path / "two" / "log.jsonl")) < 8 and not (tmp_path / "two" / "config.json").exists()
    launch(2, "train_dpo.py", *args(tmp_path / "two"), "--resume")
    one, two = read_jsonl(tmp_path / "one" / "log.jsonl"), read_jsonl(tmp_path / "two" / "log.jsonl")
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, 9))
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], abs=1e-5)
    ids = torch.tensor([tok("I WANT TO ANSWER: def f(x): return x * 2")["input_ids"]])
    m1, m2 = (AutoModelForCausalLM.from_pretrained(tmp_path / d).eval() for d in ("one", "two"))
    with torch.no_grad():
        assert torch.allclose(m1(ids).logits, m2(ids).logits, atol=1e-4)


MATERIALISE = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
from machinery import models, training
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
read, load = [], models.load_model
models.load_model = lambda *a, **k: read.append(k.get("empty", False)) or load(*a, **k)
rank, world, device = training.init_distributed()
model = training.training_model(sys.argv[1], world, device, torch.float32, False, 1)
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
saved = load(sys.argv[1], device, dtype=torch.float32)
assert read == ([True, False] if rank == 0 else [True]), read  # rank 1 never reads the weights whole
assert all(torch.equal(full[k], v) for k, v in saved.state_dict().items()) and set(full) == set(saved.state_dict())
assert all(torch.equal(b, dict(saved.named_buffers())[n]) for n, b in model.named_buffers())  # rotary frequencies
assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings stay one parameter
assert [n for n, p in model.named_parameters() if p.requires_grad][-1] == "model.norm.weight"  # --train_layers 1
ids = torch.tensor([[1, 5, 9, 12]])
assert torch.allclose(model(input_ids=ids).logits, saved(input_ids=ids).logits, atol=1e-6)
sys.stdout.write(f"rank {rank} ok\\n"); sys.stdout.flush()  # one write: the two ranks' lines cannot interleave
dist.destroy_process_group()
"""


def test_ranks_build_the_model_empty_and_get_their_shards_from_rank_0(tmp_path):
    """Under torchrun the training model is built on the meta device on every rank; rank 0 alone reads the
    checkpoint and each rank receives its shards: the same weights, buffers, ties and trainable layers as a
    model loaded whole."""
    tied = build_tiny_model(tmp_path / "tied", tie=True)
    (tmp_path / "materialise.py").write_text(MATERIALISE)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(tmp_path / "materialise.py"), tied, str(ROOT)], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert p.returncode == 0 and p.stdout.count(" ok") == 2, p.stdout[-3000:] + p.stderr[-3000:]


COLLECTIVES = """
import inspect, json, pathlib, sys, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
import common, train_dpo
from machinery import training
ours = {str(pathlib.Path(m.__file__).resolve()) for m in (common, train_dpo, training)}
calls = []
for name in ("all_reduce", "all_gather_object", "broadcast", "barrier", "all_gather"):
    real = getattr(dist, name)
    def counted(*a, _real=real, _name=name, **k):
        if inspect.currentframe().f_back.f_code.co_filename in ours:
            calls.append(_name)
        return _real(*a, **k)
    setattr(dist, name, counted)
counts = []
for epochs in (1, 3):
    calls.clear()
    out = pathlib.Path(sys.argv[3]) / f"e{epochs}"
    train_dpo.main(train_dpo.Args(mode="trajectory", trajectories=sys.argv[4], output_dir=str(out), model=sys.argv[1],
                                  lr=1e-3, epochs=epochs, batch_size=4))
    counts.append((len(calls), sum(1 for _ in open(out / "log.jsonl"))))
print("COUNTS", json.dumps(counts), flush=True)
common.close_distributed()
"""


def test_a_step_under_torchrun_makes_two_collectives_and_no_forward_messages(tiny_model, tmp_path):
    """Under torchrun the project's own collectives grow by two per extra step (the step's metrics with the gradient
    norm, and whether a save is due), whatever the forwards: lock-step is planned, not messaged. FSDP's own
    collectives (inside torch) are not counted."""
    tok = models.load_tokenizer(tiny_model)
    write_graded(tok, tmp_path / "g.jsonl", n_tasks=8)
    (tmp_path / "collectives.py").write_text(COLLECTIVES)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(tmp_path / "collectives.py"), tiny_model, str(ROOT), str(tmp_path), str(tmp_path / "g.jsonl")],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    import json
    (one, steps_one), (three, steps_three) = json.loads(p.stdout.split("COUNTS ")[1].splitlines()[0])
    assert steps_three - steps_one == 4  # 8 pairs (one a task), 4 a step: 2 steps an epoch
    assert three - one == 2 * (steps_three - steps_one), (one, three)


ACCUMULATION = """
import os, sys, torch
sys.path.insert(0, sys.argv[2])
import common
from machinery import training
rank, world, device = training.init_distributed()
model = training.training_model(sys.argv[1], world, device, torch.float32)
opt = training.make_optimizer(model, 1e-4, "constant")
examples = [torch.randint(0, 500, (1, 32), generator=torch.Generator().manual_seed(k)) for k in range(4 * world)]
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
grad = 4 * sum(p.numel() for p in model.parameters())  # the whole model's fp32 gradient
held = []
for micro in (1, 4, 4):  # micro-batches a step; the first step allocates the optimizer's state
    base = rss()
    for ids in training.micro_batches(model, examples[:micro * world], lambda ids: 1):
        training.backward(model, model(input_ids=ids, labels=ids).loss / micro)
        held.append((rss() - base) / grad)  # what the rank holds after each micro-batch, beyond the weights
    training.optimizer_step(model, opt, 1e-4)
print("HELD", rank, world, held, flush=True)
common.close_distributed()
"""


def test_gradient_accumulation_holds_only_this_ranks_shard(tmp_path):
    """Each micro-batch's gradients are reduce-scattered as its backward runs: between micro-batches a rank holds
    its shard of the fp32 gradient (half of it on two ranks), whatever the number of micro-batches; FSDP2 without
    gradient sync until the last micro-batch would hold the whole unsharded fp32 gradient (measured: 1.01 of it).
    A 21M-parameter model; resident memory, with glibc returning every freed buffer at once."""
    import json
    from transformers import LlamaConfig, LlamaForCausalLM
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                                 num_attention_heads=8, num_key_value_heads=8)).save_pretrained(tmp_path / "model")
    (tmp_path / "accumulation.py").write_text(ACCUMULATION)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(tmp_path / "accumulation.py"), str(tmp_path / "model"), str(ROOT)], capture_output=True,
                       text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"},
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for line in (l for l in p.stdout.splitlines() if l.startswith("HELD")):
        rank, world, held = line.split(" ", 3)[1:]
        held = json.loads(held)[1:]  # the steps after the first: 4 micro-batches each
        assert max(held) < 1 / int(world) + 0.1 and max(held) - min(held) < 0.1, (rank, held)
