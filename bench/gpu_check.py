"""The at-scale training path on one GPU, as one prepared check for a lent machine (one H100 or H200, no internet,
no vLLM or flash-attention): about 6 minutes at the default shapes. Models are built here from configs with random
weights rounded to bf16 (as a released bf16 checkpoint holds them), the data are synthetic trajectories of about
--tokens tokens, so nothing is downloaded.

    python3 bench/gpu_check.py --out runs/gpu_check            # on the GPU machine
    python3 bench/gpu_check.py --out /tmp/gc --shape tiny --small tiny   # a dry run of the script on a CPU

Checks, each printed PASS, FAIL or SKIP (the exit status is 1 if any fails); the numbers go to OUT/gpu_check.json
and each stage's output to OUT/NAME.log:
- critic: train_critic.py as plain `python` on the --shape model runs FSDP2 over a one-rank mesh (nccl), bf16
  compute over fp32 master weights, and at the paper's 2e-7 moves at least 90% of every trained weight matrix;
  its peak memory (gpu_peak_gib) beside training.training_memory's estimate for the longest pair.
- torchrun: the same stage under torchrun --nproc_per_node 1 (torchrun's rendezvous) gives the same losses.
- resume: train_dpo.py (multi-turn DPO) saving its state after every step, killed after its first save and rerun
  with --resume: it ends at the same step count with the whole run's losses (within 3 times the spread of two
  fresh runs at step 1: bf16 kernels on a GPU are not bitwise reproducible), and reads pi_ref's log-probs back.
- grad_ckpt: activation checkpointing inside FSDP2 (--grad_ckpt) gives the first step's loss of the run without.
- fork: label_turns.py --agent_backend vllm with a stand-in `vllm` whose engine forks a process that uses the GPU
  (vLLM's fork start, the case that fails once the parent touched CUDA): the child must succeed and labelling
  finish, vLLM's share of the GPU asked of NVML. Beside it, as information: whether a child forked after
  torch.cuda.is_available() can use the GPU on this machine (the failure the order avoids).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
SHAPES = {  # Llama-style configs: (hidden, intermediate, layers, heads, kv heads, vocab, tied)
    "tiny": (64, 128, 2, 4, 2, 512, False),
    "135m": (576, 1536, 30, 9, 3, 49152, True),  # SmolLM2-135M's
    "1b": (2048, 8192, 16, 32, 8, 128256, True),  # Llama-3.2-1B's
    "3b": (3072, 8192, 28, 24, 8, 128256, True),  # Llama-3.2-3B's
}
p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--out", required=True)
p.add_argument("--shape", default="1b", choices=SHAPES, help="the critic check's model")
p.add_argument("--small", default="135m", choices=SHAPES, help="the other checks' model")
p.add_argument("--tokens", type=int, default=4096, help="about this many tokens a successful trajectory")
p.add_argument("--stage_timeout", type=float, default=240, help="seconds a stage may run")
a = p.parse_args()
out = Path(a.out)
out.mkdir(parents=True, exist_ok=True)
results, failures = {"checks": []}, []
PY = sys.executable
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def check(name, ok, detail):
    word = "SKIP" if ok is None else "PASS" if ok else "FAIL"
    print(f"{word}  {name}: {detail}", flush=True)
    results["checks"].append({"check": name, "result": word, "detail": detail})
    if ok is False:
        failures.append(name)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")


def stage(name, cmd, env=None):
    """Run a stage as a user would; (return code, its output, seconds). The output goes to OUT/NAME.log as it runs."""
    t0 = time.time()
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**ENV, **(env or {})},
                                timeout=a.stage_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, (out / f"{name}.log").read_text(), round(time.time() - t0, 1)


def build(shape):
    """A model of this shape with the tests' tokenizer, weights rounded to bf16; its directory."""
    import torch
    from conftest import build_tiny_model
    from transformers import LlamaConfig, LlamaForCausalLM
    d = out / f"model-{shape}"
    if (d / "config.json").exists():
        return d
    build_tiny_model(d)  # the tokenizer (and a tiny model, replaced here)
    h, inter, layers, heads, kv, vocab, tied = SHAPES[shape]
    config = LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied,
                         max_position_embeddings=4 * a.tokens + 4096, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init on the GPU: seconds
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.float().cpu().save_pretrained(d)
    results.setdefault("models", {})[shape] = sum(p.numel() for p in model.parameters())
    return d


def data(model_dir):
    """8 tasks: a question then a long answer (reward 1) against a long wrong answer (reward 0)."""
    from machinery import models
    from test_training import TASK, make_traj
    tok = models.load_tokenizer(str(model_dir))
    filler = "def f(x):\n    return x * 2\n" * max(1, a.tokens // 24)  # ~12 tokens a line with the tests' tokenizer
    rows = []
    for k in range(8):
        task = dict(TASK, task_id=f"t{k}")
        rows.append(make_traj(tok, task, [f"What is the factor {k}?", f"I WANT TO ANSWER: {filler}"], ["Double it."], 1.0, 0))
        rows.append(make_traj(tok, task, [f"I WANT TO ANSWER: {filler}# {k}"], [], 0.0, 1))
    path = out / f"graded-{model_dir.name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, max(len(tok(r["dialogue_history"][-1]["input"] + r["answer"])["input_ids"]) for r in rows)


def log_of(d):
    return [json.loads(line) for line in open(Path(d) / "log.jsonl")]


def changed_share(start, trained):
    from transformers import AutoModelForCausalLM
    x = dict(AutoModelForCausalLM.from_pretrained(start).named_parameters())
    y = dict(AutoModelForCausalLM.from_pretrained(trained).named_parameters())
    keys = [k for k in x if x[k].dim() == 2 and "embed_tokens" not in k]
    return sum((x[k] != y[k]).sum().item() for k in keys) / sum(x[k].numel() for k in keys)


def fsdp_line(text):
    return next((line for line in text.splitlines() if line.startswith("FSDP2 over")), "no FSDP2 line")


import torch  # noqa: E402

gpu = torch.cuda.is_available()
backend = "nccl" if gpu else "gloo"
results["gpu"] = torch.cuda.get_device_name(0) if gpu else "none (a dry run of the script)"
results["torch"] = torch.__version__
print(f"gpu_check: {results['gpu']}, torch {torch.__version__}", flush=True)
t_start = time.time()

# --- critic: one process, FSDP2 over a one-rank mesh, 2e-7 on bf16-representable weights ---
big = build(a.shape)
graded, longest = data(big)
critic_args = ["--trajectories", graded, "--model", big, "--lr", "2e-7", "--batch_size", "4", "--epochs", "1",
               "--heldout_fraction", "0", "--max_len", str(4 * a.tokens)]
rc, text, secs = stage("critic", [PY, "train_critic.py", *map(str, critic_args), "--output_dir", str(out / "critic")])
if rc == 0:
    log = log_of(out / "critic")
    share = changed_share(big, out / "critic")
    check("critic", f"FSDP2 over 1 rank ({backend})" in text and share > 0.9,
          f"{fsdp_line(text)}; {len(log)} steps at 2e-7, {share:.3f} of the trained weights moved, {secs} s")
    if gpu:
        from machinery import training
        from transformers import AutoConfig
        held, acts = training.training_memory(AutoConfig.from_pretrained(big), 2 * longest, 1)
        peak = max(r["gpu_peak_gib"] for r in log)
        estimate = (held + acts) / 2**30
        results["memory"] = {"peak_gib": peak, "estimate_gib": estimate, "pair_tokens": 2 * longest,
                             "tokens_per_s": [r["tokens_per_s"] for r in log]}
        check("memory", peak <= estimate / 0.8, f"peak {peak:.2f} GiB, estimated {estimate:.2f} GiB for a "
              f"{2 * longest}-token pair (training_memory); the stage plans with 80% of the GPU")
else:
    check("critic", False, f"exit {rc} after {secs} s: {out / 'critic.log'}")

# --- torchrun with one process: the rendezvous path, the same numbers ---
small = build(a.small)
graded_small, _ = data(small)
base = ["--trajectories", graded_small, "--model", small, "--lr", "1e-5", "--batch_size", "4", "--heldout_fraction",
        "0", "--epochs", "1"]
rc1, text1, _ = stage("critic_plain", [PY, "train_critic.py", *map(str, base), "--output_dir", str(out / "plain")])
rc2, text2, secs = stage("critic_torchrun", [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                                            "train_critic.py", *map(str, base), "--output_dir", str(out / "torchrun")])
if rc1 == rc2 == 0:
    l1, l2 = [r["loss"] for r in log_of(out / "plain")], [r["loss"] for r in log_of(out / "torchrun")]
    check("torchrun", f"FSDP2 over 1 rank ({backend})" in text2 and max(abs(x - y) for x, y in zip(l1, l2)) < 1e-3,
          f"losses {l1} (python) and {l2} (torchrun), {secs} s")
else:
    check("torchrun", False, f"exit {rc1} / {rc2}: {out / 'critic_plain.log'}, {out / 'critic_torchrun.log'}")

# --- resume: killed after its first save, rerun with --resume ---
dpo = [PY, "train_dpo.py", "--mode", "trajectory", "--trajectories", str(graded_small), "--model", str(small),
       "--lr", "1e-5", "--batch_size", "2", "--epochs", "1"]
rc, _, _ = stage("dpo_whole", [*dpo, "--output_dir", str(out / "dpo_whole")])
resume_dir, killed = out / "dpo_killed", None
with open(out / "dpo_killed.log", "w") as f:
    proc = subprocess.Popen([*dpo, "--output_dir", str(resume_dir), "--save_minutes", "0"], cwd=ROOT, stdout=f,
                            stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    t0 = time.time()
    while proc.poll() is None and time.time() - t0 < a.stage_timeout:
        try:
            killed = json.loads((resume_dir / "resume" / "meta.json").read_text())["step"]
            break
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
rc2, text, secs = stage("dpo_resumed", [*dpo, "--output_dir", str(resume_dir), "--resume"])
if rc == 0 and rc2 == 0 and killed:
    whole, resumed = log_of(out / "dpo_whole"), log_of(resume_dir)
    # Step 1 ran fresh in both runs, before any save: their gap is the machine's own run-to-run spread (a GPU's
    # bf16 kernels are not bitwise reproducible; on a CPU it is 0). The later steps may differ by a few times it.
    spread = abs(whole[0]["loss"] - resumed[0]["loss"])
    gap = max(abs(x["loss"] - y["loss"]) for x, y in zip(whole[1:], resumed[1:]))
    tolerance = max(1e-3, 3 * spread)
    same = [r["step"] for r in whole] == [r["step"] for r in resumed] and gap <= tolerance
    cached = "reference log-probs: 8 of 8 read" in text
    check("resume", same and cached, f"killed after step {killed} was saved; the resumed run ends at step "
          f"{resumed[-1]['step']} (the whole one at {whole[-1]['step']}); its losses after step 1 within {gap:.2g} "
          f"of the whole run's (tolerance {tolerance:.2g}: 3 times the two fresh runs' spread at step 1, {spread:.2g}, "
          f"at least 1e-3); pi_ref's log-probs {'read back' if cached else 'COMPUTED AGAIN'}")
else:
    check("resume", False, f"exit {rc} / {rc2}, killed after step {killed}: {out / 'dpo_resumed.log'}")

# --- activation checkpointing inside FSDP2 ---
rc, _, secs = stage("dpo_ckpt", [*dpo, "--grad_ckpt", "--output_dir", str(out / "dpo_ckpt")])
if rc == 0 and (out / "dpo_whole" / "log.jsonl").exists():
    x, y = log_of(out / "dpo_whole")[0], log_of(out / "dpo_ckpt")[0]
    check("grad_ckpt", abs(x["loss"] - y["loss"]) < 2e-3 and abs(x["grad_norm"] - y["grad_norm"]) < 0.05 * x["grad_norm"],
          f"step 1: loss {y['loss']:.5f} against {x['loss']:.5f}, gradient norm {y['grad_norm']:.4g} against "
          f"{x['grad_norm']:.4g}, {secs} s")
else:
    check("grad_ckpt", False, f"exit {rc}: {out / 'dpo_ckpt.log'}")

# --- fork: a vLLM-like engine that forks a GPU worker, started by labelling ---
standin = out / "standin"
(standin / "vllm").mkdir(parents=True, exist_ok=True)
(standin / "vllm" / "__init__.py").write_text('''"""A stand-in for vLLM: its engine forks a worker that uses the GPU, then samples with transformers."""
import multiprocessing, os, types
import torch


def _worker():
    torch.ones(1, device="cuda").sum().item()


class SamplingParams:
    def __init__(self, seed=None, temperature=1.0, top_p=1.0, max_tokens=16):
        self.seed, self.temperature, self.top_p, self.max_tokens = seed, temperature, top_p, max_tokens


class LLM:
    def __init__(self, model, seed, max_model_len, gpu_memory_utilization, tensor_parallel_size):
        if os.environ.get("STANDIN_FORK") == "1":
            child = multiprocessing.get_context("fork").Process(target=_worker)
            child.start()
            child.join()
            print(f"STANDIN forked worker exit {child.exitcode}, share {gpu_memory_utilization}", flush=True)
            if child.exitcode != 0:
                raise RuntimeError("the forked engine worker could not use the GPU")
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model).to("cuda" if torch.cuda.is_available() else "cpu")

    def generate(self, prompts, params, use_tqdm=True):
        outs = []
        for prompt, p in zip(prompts, params):
            torch.manual_seed(p.seed)
            ids = torch.tensor([prompt["prompt_token_ids"]], device=self.model.device)
            new = self.model.generate(ids, do_sample=True, max_new_tokens=p.max_tokens, pad_token_id=0)[0, ids.shape[1]:]
            out = types.SimpleNamespace(text=self.tok.decode(new, skip_special_tokens=True), finish_reason="length")
            outs.append(types.SimpleNamespace(outputs=[out]))
        return outs
''')
if gpu and (out / "plain" / "config.json").exists():
    rc, text, secs = stage("fork", [PY, "label_turns.py", "--trajectories", str(graded_small), "--critic",
                                    str(out / "plain"), "--output", str(out / "pairs.jsonl"), "--agent_backend", "vllm",
                                    "--num_candidates", "2", "--max_new_tokens", "4", "--data_fraction", "0.25"],
                           env={"PYTHONPATH": str(standin), "STANDIN_FORK": "1"})
    worker = next((line for line in text.splitlines() if line.startswith("STANDIN")), "no engine started")
    states = len((out / "pairs.jsonl.states.jsonl").read_text().splitlines()) if rc == 0 else 0
    check("fork", rc == 0 and "exit 0" in worker and states > 0,
          f"{worker}; labelling exit {rc}, {states} states labelled, {secs} s")
    probe = ("import multiprocessing, torch\ntorch.cuda.is_available()\n"
             "c = multiprocessing.get_context('fork').Process(target=lambda: torch.ones(1, device='cuda').sum().item())\n"
             "c.start(); c.join(); print('EXIT', c.exitcode)")
    rc, text, _ = stage("fork_after_query", [PY, "-c", probe])
    results["fork_after_is_available"] = text.strip().splitlines()[-1:]
    print(f"INFO  a child forked after torch.cuda.is_available(): {text.strip().splitlines()[-1:]}", flush=True)
else:
    check("fork", None, "needs a GPU (and the critic_plain stage)")

results["seconds"] = round(time.time() - t_start)
(out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
print(f"gpu_check: {len(failures)} failed ({', '.join(failures) or 'none'}) in {results['seconds']} s", flush=True)
sys.exit(1 if failures else 0)
