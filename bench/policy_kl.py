"""How far a trained policy moved from its start: KL(pi || pi_start), estimated on the policy's own dialogues.

    python bench/policy_kl.py --policy RUN/policy_sweet --start runs/start-HASH/policy_warm \
        --trajectories RUN/val_sweet_end.jsonl

The dialogues must be the policy's own, sampled at temperature 1 and top_p 1 (run.sh's validation rollouts are).
At each agent turn, log pi(a | o) - log pi_start(a | o) summed over the turn's tokens is then an unbiased sample of
KL(pi(. | o) || pi_start(. | o)) for that turn (a turn cut at --max_new_tokens: of the cut distribution). Prints
the mean per turn (with a 95% interval, dialogues resampled) and per token: how far a policy kept by validation
moved, the number the tuning table reports beside its validation success (0 when selection kept the start).
"""
import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import colbench  # noqa: E402
import common  # noqa: E402
from machinery import models  # noqa: E402


def turn_sums(name, tok, trajs):
    """[(sum over each turn's tokens of log p, token counts)] of every dialogue under the model `name`."""
    model, out = models.load_model(name, torch.device("cpu")).eval(), []
    for t in common.tqdm_if(trajs, True, Path(name).name):
        turns = colbench.agent_turns(t)
        with torch.no_grad():
            s, n = common.turn_logprobs(model, [(common.tokenize_turns(tok, turns), len(turns))])[0]
        out.append((s.tolist(), n.tolist()))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", required=True)
    ap.add_argument("--start", required=True)
    ap.add_argument("--trajectories", required=True, help="the policy's own dialogues (rollout.py's JSONL)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    trajs = [r for _, r in common.read_jsonl(a.trajectories) if colbench.agent_turns(r)]
    if not trajs:
        common.refuse(f"{a.trajectories}: no dialogue with an agent turn")
    tok = models.load_tokenizer(a.policy)
    pol, ref = turn_sums(a.policy, tok, trajs), turn_sums(a.start, tok, trajs)
    per = [(sum(p - r for p, r in zip(ps, rs)), len(ps), sum(n)) for (ps, n), (rs, _) in zip(pol, ref)]

    def stats(rows):
        kl, turns, tokens = (sum(x[i] for x in rows) for i in range(3))
        return kl / turns, kl / tokens
    rng = random.Random(a.seed)
    boot = sorted(stats([rng.choice(per) for _ in per]) for _ in range(1000))
    (turn, token), lo, hi = stats(per), boot[25][0], boot[974][0]
    out = {"policy": a.policy, "start": a.start, "dialogues": len(per), "turns": sum(x[1] for x in per),
           "kl_per_turn": turn, "kl_per_turn_95": [lo, hi], "kl_per_token": token}
    print(f"KL(policy || start) on {len(per)} of its dialogues ({out['turns']} turns): {turn:.3f} nats a turn "
          f"[{lo:.3f}, {hi:.3f}], {token:.4f} a token")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
