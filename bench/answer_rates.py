"""When does a policy answer? Its probability of starting a turn with the answer marker, over the
states of graded dialogues (procedural code tasks), split by whether the human had already said
every hidden fact (full) or not (partial). A policy that collaborates well answers in full states
and asks in partial ones; turn-level DPO should widen that gap, not just move both.

    python bench/answer_rates.py --policies runs/default/policy_warm,runs/default/policy_sweet \
        --trajectories runs/default/train_graded.jsonl

Prints one JSON line per policy: p_answer_full, p_answer_partial (means over up to --num_states/2
states of each kind, the same states for every policy) and the log-odds gap between them.
"""
import argparse
import json
import math
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import colbench  # noqa: E402
import common  # noqa: E402
from machinery import models  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--policies", required=True, help="comma-separated HF checkpoints")
p.add_argument("--trajectories", required=True, help="graded dialogues whose agent turns' stored inputs are the states")
p.add_argument("--num_states", type=int, default=160)
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()

states = []
for t in colbench.load_graded(a.trajectories):
    d = t["dialogue_history"]
    for j, m in enumerate(d):
        if m["role"] == "assistant" and "input" in m:
            states.append((colbench.knows_every_fact(t["task"], d[:j]), m["input"]))
random.Random(a.seed).shuffle(states)
chosen = [s for s in states if s[0]][: a.num_states // 2] + [s for s in states if not s[0]][: a.num_states // 2]
logit = lambda q: math.log(q / (1 - q))
for policy in a.policies.split(","):
    tok = models.load_tokenizer(policy)
    model = models.load_model(policy, models.local_device()).eval()
    marker = tok(colbench.ANSWER_MARKER, add_special_tokens=False)["input_ids"]
    probs = {True: [], False: []}
    with torch.no_grad():
        for full, prompt in chosen:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            x = torch.tensor([ids + marker], device=model.device)
            logits = model(x).logits[0, len(ids) - 1:-1]  # the positions that predict the marker's tokens
            probs[full].append(common.token_logprobs(logits, x[0, len(ids):]).sum().exp().item())
    pf, pp = (sum(v) / max(len(v), 1) for v in (probs[True], probs[False]))
    print(json.dumps({"policy": policy, "p_answer_full": round(pf, 3), "p_answer_partial": round(pp, 3),
                      "log_odds_gap": round(logit(pf) - logit(pp), 3) if 0 < pp and pf < 1 else None,
                      "n_full": len(probs[True]), "n_partial": len(probs[False])}), flush=True)
