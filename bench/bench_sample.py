"""Candidate sampling as label_turns does it: N candidates for each of K states, one batch.
Ours (models.HFSampler: the N samples of a prompt share one prefill, a finished row leaves the
batch) against transformers' generate on the left-padded batch of K x N prompts (what HFSampler
called before). Same temperature and max_new_tokens; reports candidates per second of each and
their lengths (different random draws, so the lengths differ a little).

    python bench/bench_sample.py --model runs/default/policy_warm --trajectories runs/default/train_graded.jsonl
"""
import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import colbench  # noqa: E402
from machinery import models  # noqa: E402

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--model", default="embedded")
p.add_argument("--trajectories", required=True, help="graded trajectories: their agent turns' inputs are the states")
p.add_argument("--states", type=int, default=8)
p.add_argument("--num_candidates", type=int, default=8)
p.add_argument("--max_new_tokens", type=int, default=96)
p.add_argument("--temperature", type=float, default=1.0)
a = p.parse_args()
graded = colbench.load_graded(a.trajectories)
random.Random(0).shuffle(graded)
states = [inp for t in graded for inp, _ in colbench.agent_turns(t)][:a.states]
prompts = [s for s in states for _ in range(a.num_candidates)]
sampler = models.HFSampler(a.model, a.temperature, 1.0, a.max_new_tokens)
tok = sampler.tok
ends = {tok.eos_token_id, tok.pad_token_id}
length = lambda ids: next((i + 1 for i, t in enumerate(ids) if t in ends), len(ids))

torch.manual_seed(0)
t0 = time.time()
ours = sampler.generate(prompts)
t_ours = time.time() - t0

torch.manual_seed(0)
batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
t0 = time.time()
with torch.no_grad():
    out = sampler.model.generate(**batch, max_new_tokens=a.max_new_tokens, do_sample=True, temperature=a.temperature,
                                 top_p=1.0, top_k=None, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
t_hf = time.time() - t0
hf_len = [length(r) for r in out[:, batch["input_ids"].shape[1]:].tolist()]

n = len(prompts)
print(f"{a.states} states x {a.num_candidates} candidates, prompts {batch['attention_mask'].sum(1).min().item()}-"
      f"{batch['input_ids'].shape[1]} tokens (padded), max_new_tokens {a.max_new_tokens}, {torch.get_num_threads()} threads")
print(f"ours (shared prefill, finished rows leave): {t_ours:.1f} s, {n / t_ours:.2f} candidates/s, "
      f"candidate tokens mean {sampler.rows_decoded / n:.1f} (a row decodes once per token it picks)")
print(f"transformers generate (padded K x N batch): {t_hf:.1f} s, {n / t_hf:.2f} candidates/s, "
      f"candidate tokens mean {sum(hf_len) / n:.1f} max {max(hf_len)}, every row decodes {out.shape[1] - batch['input_ids'].shape[1]} steps")
print(f"speed-up {t_hf / t_ours:.2f}x")
