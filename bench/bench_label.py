"""label_turns scoring: prompt reuse (KV cache, candidates as a batch) vs naive one-by-one scoring,
N candidates of a state. Reports candidates scored per second.

    python bench/bench_label.py --model embedded --num_candidates 16 --prompt_tokens 600 --candidate_tokens 40
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import common  # noqa: E402
from machinery import models  # noqa: E402

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--model", default="embedded")
p.add_argument("--num_candidates", type=int, default=16)
p.add_argument("--prompt_tokens", type=int, default=600)
p.add_argument("--candidate_tokens", type=int, default=40)
a = p.parse_args()
model = models.load_model(a.model, torch.device("cpu")).eval()
g = torch.Generator().manual_seed(0)
prompt = torch.randint(100, 40000, (a.prompt_tokens,), generator=g).tolist()
cands = [torch.randint(100, 40000, (a.candidate_tokens,), generator=g).tolist() for _ in range(a.num_candidates)]
with torch.no_grad():
    t0 = time.time()
    sums, counts = common.shared_prompt_logprobs(model, prompt, cands)
    fast = sums / counts
    t_fast = time.time() - t0
    t0 = time.time()
    slow = []
    for c in cands:
        s, n = common.turn_logprobs(model, [([(prompt + c, [-1] * len(prompt) + [0] * len(c))], 1)])[0]
        slow.append((s / n).item())
    t_slow = time.time() - t0
print(f"N={a.num_candidates}, prompt {a.prompt_tokens} tokens, candidates {a.candidate_tokens} tokens: "
      f"reuse {a.num_candidates / t_fast:.2f} cand/s, naive {a.num_candidates / t_slow:.2f} cand/s, "
      f"speed-up {t_slow / t_fast:.1f}x, max |diff| {max(abs(x - y) for x, y in zip(fast.tolist(), slow)):.2e}")
