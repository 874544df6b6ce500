"""Decoding speed of html rollouts: the hf sampler's draw and matmul precision, on real dialogues.

Runs rollout.py as run.sh's html default does (temperature 1.0, top_p 1.0, batch 64, up to 192 new
tokens a turn) on procedural pages with the scripted human, four ways, and reports each one's wall time:
  multinomial  fp32 matmuls, each token drawn by torch.multinomial (the sampler before 2026-11-25)
  cdf          fp32 matmuls, each token drawn by inverting the row's cumulative distribution (models.sample_rows)
  cdf+bf16     the same with --decode_dtype bfloat16 (bf16 matmuls on fp32 weights, models.bf16_matmuls), its
               KV cache in fp32 read by SDPA (the sampler before 2026-11-28)
  cdf+bf16kv   --decode_dtype bfloat16 as it is now: also a bf16 KV cache (models.bf16_kv_attention)
The untrained embedded model never answers, so every dialogue runs --max_turns turns of long turns.

    python bench/bench_decode.py                       # 48 pages, 4 turns each (~21 min on 2 cores)
    python bench/bench_decode.py --num_tasks 8 --max_turns 2 --variants cdf+bf16,cdf+bf16kv
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", default="embedded")
p.add_argument("--num_tasks", type=int, default=48)
p.add_argument("--max_turns", type=int, default=4)
p.add_argument("--max_new_tokens", type=int, default=192)
p.add_argument("--variants", default="multinomial,cdf,cdf+bf16,cdf+bf16kv")
a = p.parse_args()
py = sys.executable
# the earlier samplers: rollout.py with models.sample_rows swapped for torch.multinomial (the same distribution), or
# without the bf16 KV cache
RUN = "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
BEFORE = {"multinomial": "models.sample_rows = lambda p: torch.multinomial(p, 1).squeeze(1)",
          "cdf+bf16": "models.bf16_kv_attention = lambda m: (m, None)"}
with tempfile.TemporaryDirectory() as d:
    sim = subprocess.Popen([py, "simulator.py", "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    url = sim.stdout.readline().split("ready at ")[1].strip().removesuffix("/v1")
    subprocess.run([py, "generate_tasks.py", "--task_type", "html", "--num_tasks", str(a.num_tasks), "--seed", "1",
                    "--output", f"{d}/t.jsonl"], cwd=ROOT, check=True, capture_output=True)
    try:
        for variant in a.variants.split(","):
            out = f"{d}/{variant}.jsonl"
            head = [py, "-c", f"import runpy, sys, torch, models; {BEFORE[variant]}; {RUN}"] if variant in BEFORE else [py]
            t0 = time.time()
            subprocess.run([*head, "rollout.py", "--tasks", f"{d}/t.jsonl", "--output", out, "--agent_model", a.model,
                            "--agent_backend", "hf", "--simulator_url", url, "--task_type", "html", "--temperature", "1.0",
                            "--top_p", "1.0", "--max_turns", str(a.max_turns), "--max_new_tokens", str(a.max_new_tokens),
                            "--batch_size", "64", "--seed", "0",
                            "--decode_dtype", "bfloat16" if "bf16" in variant else "float32"],
                           cwd=ROOT, check=True, capture_output=True)
            dt = time.time() - t0
            rows = [json.loads(line) for line in open(out)]
            tokens = sum(len(m["content"]) for r in rows for m in r["dialogue_history"] if m["role"] == "assistant")
            print(f"{variant:12s} {len(rows)} dialogues, {sum(r['num_turns'] for r in rows)} agent turns "
                  f"({tokens} characters) in {dt:.1f} s (model load included)", flush=True)
    finally:
        sim.terminate()
