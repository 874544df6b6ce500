"""fp32 against bf16 on this CPU, for the model run.sh trains: a training step (forward, backward and
AdamW on fp32 weights, under bf16 autocast or not, as train_dpo.py/train_critic.py --dtype run it)
and a decoding step (one new token per row on a KV cache, weights in the dtype, as HFSampler would
run them). Reports seconds per step, the median of --repeats after one warm-up step.

    python bench/bench_dtype.py                       # the embedded model
    python bench/bench_dtype.py --model runs/default/policy_warm --rows 32 --context 600
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import common  # noqa: E402
import models  # noqa: E402

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--model", default="embedded")
p.add_argument("--train_rows", type=int, default=4)
p.add_argument("--train_tokens", type=int, default=512)
p.add_argument("--rows", type=int, default=32, help="decoding: rows in the batch")
p.add_argument("--context", type=int, default=600, help="decoding: tokens already in the cache")
p.add_argument("--repeats", type=int, default=3)
a = p.parse_args()
path = models.resolve_model(a.model)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}")


def timed(step, n):
    step()  # warm-up: the first call builds the kernels for these shapes
    out = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
ids = torch.randint(0, 1000, (a.train_rows, a.train_tokens))
for dtype in (torch.float32, torch.bfloat16):
    def train_step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    s = timed(train_step, a.repeats)
    print(f"train step, {a.train_rows} x {a.train_tokens} tokens, {str(dtype)[6:]} autocast: {s:.2f} s "
          f"({a.train_rows * a.train_tokens / s:.0f} tokens/s)", flush=True)
del model, opt
ctx = torch.randint(0, 1000, (a.rows, a.context))
for dtype in (torch.float32, torch.bfloat16):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        cache = common.cache_of(model(input_ids=ctx, use_cache=True, **common.with_cache(model, models.growing_cache(64))))

        def decode_step():
            model(input_ids=ctx[:, :1], **common.with_cache(model, cache), use_cache=True, logits_to_keep=1)
            cache.crop(-1)  # keep the cache at --context tokens
        s = timed(decode_step, a.repeats * 5)
    print(f"decoding step, {a.rows} rows on {a.context} cached tokens, {str(dtype)[6:]} weights: {s * 1000:.0f} ms", flush=True)
