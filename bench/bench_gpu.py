"""The GPU paths, run on a GPU: the critic and turn-level DPO under torchrun (nccl, FSDP2, bf16
compute over fp32 master weights, activation checkpointing) at the paper's 2e-7 step, labelling and
rollouts with the HF sampler, each with its wall time and the GPU's peak memory. Models are built
from configs with random weights rounded to bf16 (as a released bf16 checkpoint holds them), so
nothing is downloaded; the data are a finished run's trajectories and turn-level pairs.

    python bench/bench_gpu.py --run_dir runs/default --tokenizer ~/.cache/sweetrl/SmolLM2-135M-Instruct \
        --out runs/bench_gpu                      # shapes 135m (SmolLM2's own config), 1b, 3b (Llama-3.2's)

Checks, each printed PASS or FAIL (the exit status is 1 if any fails):
- after one critic run and one DPO run at lr 2e-7, at least 90% of the elements of every trained
  weight matrix differ from the start (fp32 master weights; on bf16 weights such a step rounds away);
- the same DPO run saved with --save_dtype bfloat16 keeps under 5% of them (the rounding the README
  warns about, seen on the GPU);
- labelling writes turn-level pairs, and rollouts (8 code tasks x 2, at most 4 turns) finish.
Each stage's output goes to OUT/NAME.log as it runs, the numbers to OUT/bench_gpu.json; each training stage
also prints its MFU (6 x parameters x tokens/s over --peak_tflops).
"""
import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--run_dir", required=True, help="a finished html run: its train_graded.jsonl and pairs.jsonl")
p.add_argument("--tokenizer", required=True, help="a folder with the tokenizer files and SmolLM2-135M's config.json")
p.add_argument("--out", required=True)
p.add_argument("--shapes", default="135m,1b", help="comma-separated: 135m, 1b, 3b")
p.add_argument("--dpo_epochs", type=float, default=1.0)
p.add_argument("--peak_tflops", type=float, default=989.0, help="the GPU's dense bf16 peak, for MFU (H100 / H200 SXM: 989)")
p.add_argument("--max_tasks", type=int, default=8, help="the first N tasks' trajectories and their turn-level pairs (0: all)")
p.add_argument("--stage_timeout", type=float, default=600, help="seconds a stage may run")
p.add_argument("--stages", default="critic,dpo,dpo_bf16,label,rollout", help="which to run (label and rollout: 135m only)")
p.add_argument("--code_tasks", default="", help="the rollout stage's code tasks (default: 8 made here, which runs their "
               "ground truths in the sandbox; pass a file made elsewhere where no sandbox runs)")
a = p.parse_args()
if unknown := set(a.shapes.split(",")) - {"135m", "1b", "3b"}:
    p.error(f"--shapes: unknown {', '.join(sorted(unknown))}; choose from 135m, 1b, 3b")
out = Path(a.out)
out.mkdir(parents=True, exist_ok=True)
results, failures = {}, []


def check(name, ok, detail):
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    results.setdefault("checks", []).append({"check": name, "ok": bool(ok), "detail": detail})
    if not ok:
        failures.append(name)


def gpu_memory_mib():
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
    except FileNotFoundError:
        return 0
    return int(q.stdout.split()[0]) if q.returncode == 0 and q.stdout.strip() else 0


def stage(name, cmd, timeout=None):
    """Run one stage as a user would (a subprocess); its wall time and the GPU's peak memory in use."""
    peak, done = [0], threading.Event()

    def poll():
        while not done.wait(0.2):
            peak[0] = max(peak[0], gpu_memory_mib())
    t = threading.Thread(target=poll, daemon=True)
    t.start()
    t0 = time.time()
    with open(out / f"{name}.log", "w") as log:  # written as it runs: a stage cut short keeps its log
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                timeout=timeout or a.stage_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    done.set()
    t.join()
    wall = time.time() - t0
    results[name] = {"wall_s": round(wall, 1), "peak_gpu_mib": peak[0], "rc": rc}
    print(f"{name}: rc {rc}, {wall:.1f} s, peak GPU memory {peak[0]} MiB", flush=True)
    if rc:
        print((out / f"{name}.log").read_text()[-3000:], flush=True)
    return rc == 0


def build(shape):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig
    d = out / f"model_{shape}"
    if (d / "config.json").exists():
        return d
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    if shape == "135m":
        cfg = AutoConfig.from_pretrained(a.tokenizer)
    else:  # Llama-3.2-1B's or -3B's shape on SmolLM2's vocabulary
        hidden, layers, heads = {"1b": (2048, 16, 32), "3b": (3072, 28, 24)}[shape]
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=8192, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=8, max_position_embeddings=8192,
                          rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for q in model.parameters():
            q.copy_(q.to(torch.bfloat16).float())
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def changed_share(start, trained):
    """share of the elements of every 2-D weight (embeddings aside) that differ from the start"""
    from safetensors.torch import load_file
    s, t = load_file(str(Path(start, "model.safetensors"))), load_file(str(Path(trained, "model.safetensors")))
    keys = [k for k in s if s[k].dim() == 2 and "embed" not in k and "lm_head" not in k]
    return sum((s[k].float() != t[k].float()).sum().item() for k in keys) / sum(s[k].numel() for k in keys)


run = Path(a.run_dir)
rows = [json.loads(x) for x in open(run / "train_graded.jsonl")]
kept = set(list(dict.fromkeys(r["task_id"] for r in rows))[:a.max_tasks or None])
graded, pairs, no_facts = out / "train_graded.jsonl", out / "pairs.jsonl", out / "train_graded_no_facts.jsonl"
with open(graded, "w") as g, open(no_facts, "w") as h:
    for r in rows:
        if r["task_id"] in kept:
            g.write(json.dumps(r) + "\n")
            r["task"].pop("hidden_information", None)  # labelling without true classes (they need a browser)
            h.write(json.dumps(r) + "\n")
with open(pairs, "w") as g:
    g.writelines(x for x in open(run / "pairs.jsonl") if json.loads(x)["task_id"] in kept)
stages = a.stages.split(",")
torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
train = ["--task_type", "html", "--lr", "2e-7", "--batch_size", "8", "--dtype", "auto"]  # checkpointing where memory needs it


def save():
    (out / "bench_gpu.json").write_text(json.dumps(results, indent=1))


def trained(name, model, out_dir, cmd, check_name, moved=True):
    """run a training stage; check the share of weight elements its 2e-7 steps changed"""
    if stage(name, cmd):
        steps = [json.loads(x) for x in open(out_dir / "log.jsonl")]
        results[name].update(steps=len(steps), last_loss=steps[-1].get("loss"))
        # MFU: 6 x parameters x trained tokens/s (forward and backward) over the peak; the median step, the first aside
        from safetensors import safe_open
        with safe_open(str(Path(model, "model.safetensors")), "pt") as f:
            params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
        rate = statistics.median(r["tokens_per_s"] for r in steps[1:] or steps)
        results[name].update(params=params, tokens_per_s=round(rate), mfu=round(6 * params * rate / (a.peak_tflops * 1e12), 4))
        print(f"{name}: {rate:.0f} tokens/s, {params / 1e9:.2f}B parameters: MFU {100 * results[name]['mfu']:.1f}% of "
              f"{a.peak_tflops:.0f} TFLOP/s", flush=True)
        share = changed_share(model, out_dir)
        check(check_name, share > 0.9 if moved else share < 0.05, f"{100 * share:.1f}% of weight elements changed")
    else:
        check(check_name, False, f"the stage failed: {out / name}.log")
    save()


import torch  # noqa: E402
results.update(device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", torch=torch.__version__)
print(f"device {results['device']}, torch {torch.__version__}", flush=True)
for shape in a.shapes.split(","):
    model = build(shape)
    critic = out / f"critic_{shape}"
    if "critic" in stages:
        trained(f"critic_{shape}", model, critic, torchrun + [
            "train_critic.py", "--trajectories", str(graded), "--model", str(model), "--output_dir", str(critic),
            "--epochs", "1", *train], f"critic {shape}: lr 2e-7 moves the weights")
    dpo = ["train_dpo.py", "--mode", "turn", "--pairs", str(pairs), "--model", str(model), "--epochs", str(a.dpo_epochs), *train]
    if "dpo" in stages:
        trained(f"dpo_{shape}", model, out / f"dpo_{shape}", torchrun + dpo + ["--output_dir", str(out / f"dpo_{shape}")],
                f"dpo {shape}: lr 2e-7 moves the weights")
    if shape != "135m":
        continue
    if "dpo_bf16" in stages:
        trained("dpo_135m_save_bf16", model, out / "dpo_135m_bf16",
                torchrun + dpo + ["--output_dir", str(out / "dpo_135m_bf16"), "--save_dtype", "bfloat16"],
                "dpo 135m saved in bf16 loses the 2e-7 updates", moved=False)
    if "label" in stages and critic.exists():
        labelled = out / "pairs_135m.jsonl"
        ok = stage("label_135m", [sys.executable, "label_turns.py", "--trajectories", str(no_facts), "--critic", str(critic),
                                  "--output", str(labelled), "--data_fraction", "0.5", "--agent_backend", "hf",
                                  "--max_new_tokens", "192"])
        n_states = sum(1 for _ in open(f"{labelled}.states.jsonl")) if Path(f"{labelled}.states.jsonl").exists() else 0
        n_pairs = sum(1 for _ in open(labelled)) if labelled.exists() else 0
        results["label_135m"].update(states=n_states, pairs=n_pairs)
        check("labelling writes turn-level pairs", ok and n_pairs > 0, f"{n_states} states, {n_pairs} pairs")
        save()
    if "rollout" in stages:
        tasks, dialogues = Path(a.code_tasks or out / "code_tasks.jsonl"), out / "rollouts_135m.jsonl"
        if not a.code_tasks:
            subprocess.run([sys.executable, "generate_tasks.py", "--num_tasks", "8", "--seed", "7", "--output", str(tasks)],
                           cwd=ROOT, check=True, capture_output=True)
        sim_log = out / "simulator.log"  # as run.sh starts it: any free port, the URL read from its log
        sim = subprocess.Popen([sys.executable, "simulator.py", "--port", "0"], cwd=ROOT,
                               stdout=open(sim_log, "w"), stderr=subprocess.STDOUT)
        url = ""
        for _ in range(300):
            found = re.search(r"ready at (http\S+)/v1", sim_log.read_text())
            if found or sim.poll() is not None:
                url = found.group(1) if found else ""
                break
            time.sleep(0.1)
        ok = bool(url) and stage("rollout_135m", [sys.executable, "rollout.py", "--tasks", str(tasks), "--output", str(dialogues),
                                                  "--agent_backend", "hf", "--agent_model", str(model), "--simulator_url", url,
                                                  "--samples", "2", "--max_turns", "4", "--max_new_tokens", "128"])
        sim.terminate()
        done = [json.loads(x) for x in open(dialogues)] if dialogues.exists() else []
        results.setdefault("rollout_135m", {}).update(dialogues=len(done), simulator=url or f"did not start: {sim_log}")
        check("rollouts finish", ok and len(done) == 16, f"{len(done)} of 16 dialogues")
        save()

save()
sys.exit(1 if failures else 0)
