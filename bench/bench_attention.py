"""A decoding step of the hf sampler with bf16 matmuls (--decode_dtype bfloat16), by rows and cached tokens:
  fp32 cache   its KV cache in fp32, read by transformers' SDPA (the sampler before 2026-11-28)
  bf16 cache   the KV cache in bf16, each whole buffer read by two bf16 matmuls (models.bf16_kv_attention)
Each case: a prefill of random tokens, then --steps decoding steps, timed; the model is the embedded one
unless --model names another.

    python bench/bench_attention.py                          # 16 and 48 rows x 300 and 1,200 cached tokens
    python bench/bench_attention.py --rows 64 --cached 2000 --model runs/default/policy_sweet
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import common  # noqa: E402
import models  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", default="embedded")
p.add_argument("--rows", default="16,48")
p.add_argument("--cached", default="300,1200")
p.add_argument("--steps", type=int, default=20)
a = p.parse_args()

sampler = models.HFSampler(a.model, 1.0, 1.0, 192, decode_dtype="bfloat16")
plain = models.HFSampler(a.model, 1.0, 1.0, 192)
cases = {"fp32 cache": (models.bf16_matmuls(plain.model), None), "bf16 cache": (sampler.model, sampler.kv_dtype)}
print(f"{'rows':>4} {'cached':>6}  " + "  ".join(f"{name:>14}" for name in cases) + "   ratio")
for rows in map(int, a.rows.split(",")):
    for cached in map(int, a.cached.split(",")):
        ms = []
        for model, kv_dtype in cases.values():
            torch.manual_seed(0)
            ids = torch.randint(100, 1000, (rows, cached))
            mask = torch.ones_like(ids)
            cache = models.growing_cache(a.steps + 1, kv_dtype)
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask, logits_to_keep=1, **common.with_cache(model, cache))
                token, t0 = ids[:, -1:], time.time()
                for step in range(a.steps):
                    mask = torch.cat([mask, mask.new_ones((rows, 1))], 1)
                    pos = torch.full((rows, 1), cached + step)
                    out = model(input_ids=token, attention_mask=mask, position_ids=pos, logits_to_keep=1,
                                **common.with_cache(model, cache))
                    token = sampler._pick(out.logits[:, -1].float())[:, None]
            ms.append((time.time() - t0) / a.steps * 1000)
        print(f"{rows:>4} {cached:>6}  " + "  ".join(f"{m:>11.1f} ms" for m in ms) + f"   {ms[1] / ms[0]:.2f}x", flush=True)
