"""Peak memory of the hf sampler's multi-turn decoding with each dialogue's KV cache kept between turns (rollout.py's
default): N dialogues, T turns, each human reply a fixed number of tokens, so the dialogues grow as long html ones
do. Reports the process's peak resident memory and the size of one copy of the dialogues' caches at the end.

    python bench/bench_rollout_memory.py --model embedded --dialogues 16 --turns 6 --reply_tokens 300
"""
import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import colbench  # noqa: E402
from machinery import models  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", default="embedded")
p.add_argument("--dialogues", type=int, default=16)
p.add_argument("--turns", type=int, default=6)
p.add_argument("--reply_tokens", type=int, default=300, help="about this many tokens in each human reply")
p.add_argument("--max_new_tokens", type=int, default=64)
a = p.parse_args()

sampler = models.HFSampler(models.resolve_model(a.model), 1.0, 1.0, a.max_new_tokens, reuse_cache=True)
models.seed_everything(0)
reply = " ".join(["blue"] * a.reply_tokens)
dialogues = [[{"role": "user", "content": f"Page {i}: {reply}"}] for i in range(a.dialogues)]
t0 = time.time()
for turn in range(a.turns):
    prompts = [models.render_prompt(sampler.tok, colbench.agent_messages({}, d)) for d in dialogues]
    for d, o in zip(dialogues, sampler.generate(prompts, [f"d{i}/{turn}" for i in range(a.dialogues)])):
        d += [{"role": "assistant", "content": o}, {"role": "user", "content": reply}]
tokens = sum(len(ids) for ids, _ in sampler.cache.values())
cache_gib = sum(t.numel() * t.element_size() for _, layers in sampler.cache.values() for kv in layers for t in kv) / 2**30
peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux
print(f"{a.dialogues} dialogues x {a.turns} turns ({tokens / a.dialogues:.0f} tokens each at the end) in {time.time() - t0:.0f} s: "
      f"peak memory {peak_gib:.2f} GiB; one copy of the dialogues' KV caches {cache_gib:.2f} GiB")
