"""Rollout speed: the hf backend with all dialogues batched (each dialogue's KV cache kept between
turns, and not) vs one dialogue at a time (same tasks, model, token limits). Reports agent turns
per second.

    python bench/bench_rollout.py --model embedded --num_tasks 8
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
a = p.parse_args()
py = sys.executable
with tempfile.TemporaryDirectory() as d:
    sim = subprocess.Popen([py, "simulator.py", "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    url = sim.stdout.readline().split("ready at ")[1].strip().removesuffix("/v1")
    subprocess.run([py, "generate_tasks.py", "--num_tasks", str(a.num_tasks), "--seed", "7", "--output", f"{d}/t.jsonl"],
                   cwd=ROOT, check=True, capture_output=True)
    rates = {}
    for bs, reuse in ((a.num_tasks, True), (a.num_tasks, False), (1, False)):
        out = f"{d}/r{bs}{reuse}.jsonl"
        t0 = time.time()
        subprocess.run([py, "rollout.py", "--tasks", f"{d}/t.jsonl", "--output", out, "--agent_model", a.model,
                        "--simulator_url", url, "--max_turns", str(a.max_turns), "--max_new_tokens", str(a.max_new_tokens),
                        "--batch_size", str(bs), "--seed", "0", *([] if reuse else ["--no_reuse_cache"])],
                       cwd=ROOT, check=True, capture_output=True)
        dt = time.time() - t0
        turns = sum(json.loads(l)["num_turns"] for l in open(out))
        rates[bs, reuse] = turns / dt
        print(f"batch_size={bs:<3} KV cache kept between turns: {'yes' if reuse else 'no ':3} {turns} agent turns in "
              f"{dt:.1f} s -> {turns / dt:.3f} turns/s (includes ~5 s model load)", flush=True)
    print(f"batched with the cache kept vs one at a time: {rates[a.num_tasks, True] / rates[1, False]:.2f}x; "
          f"batched, cache kept vs not: {rates[a.num_tasks, True] / rates[a.num_tasks, False]:.2f}x")
    sim.kill()
