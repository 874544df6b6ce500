"""Train the policy: SWEET-RL's turn-level DPO, or the paper's baselines.

Reads:  --mode turn:       PAIRS JSONL from label_turns.py (prompt, chosen, rejected, ...)
        --mode trajectory: graded trajectories -> trajectory pairs (multi-turn DPO)
        --mode sft:        graded trajectories -> agent turns of successful ones (rejection fine-tuning)
Writes: an HF checkpoint in --output_dir (+ run_settings.json, log.jsonl).

    python train_dpo.py --pairs runs/pairs.jsonl --model embedded --output_dir runs/sweet
    python train_dpo.py --mode trajectory --trajectories runs/train_graded.jsonl --output_dir runs/mtdpo
    python train_dpo.py --mode sft --trajectories runs/train_graded.jsonl --output_dir runs/rft
    torchrun --nproc_per_node 8 train_dpo.py ...     # FSDP2, same arguments

The update (the paper, arXiv 2503.15478, Sec. 4), with logp = log pi(a|o) summed over the turn's tokens:
    L = -log sigmoid(beta * [logp(a+) - logp_ref(a+)] - beta * [logp(a-) - logp_ref(a-)]) + nll_coef * NLL(a+)
The actor never sees c. pi_ref is the starting policy, scored once before training. Logged with
TRL's names: rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, nll, loss.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import colbench
import common
from machinery import training


@dataclass(kw_only=True)
class Args(training.TrainerArgs):
    output_dir: str
    """where to save the trained policy (HF checkpoint)"""
    mode: str = "turn"
    """turn (SWEET-RL) | trajectory (multi-turn DPO baseline) | sft (rejection fine-tuning)"""
    pairs: str = ""
    """turn mode: PAIRS JSONL from label_turns.py"""
    trajectories: str = ""
    """trajectory/sft modes: graded trajectories JSONL"""
    nll_coef: float = 0.01
    """weight of the NLL of the chosen turn (lambda)"""
    epochs: float = 1
    """passes over the data; a fraction ends the last pass early"""
    steps: int = 0
    """optimizer steps instead of --epochs (0: --epochs decides); past a pass the data repeats, reshuffled. run.sh
    gives every method the same steps: an equal budget"""
    max_len: int = 16384
    """longest token sequence; longer ones keep their last max_len tokens"""
    sft_on: str = "success"
    """sft mode: success (rejection fine-tuning: successful dialogues only) | all (every dialogue: the embedded
    warm-up)"""
    snapshots: int = 0
    """also save the policy at N evenly spaced steps before the last, to OUTPUT_DIR/step-K (run.sh rolls each
    out on validation tasks and keeps the best, the starting policy included: docs/curriculum.md)"""


# ==================================== POLICY LOSS ==============================================
# The whole policy objective of every mode is here. Inputs are log-probs summed over a side's agent tokens
# (common.turn_logprobs or its fast path), pi_ref's computed once before training, and the chosen side's
# token count. The actor never sees c.
def dpo_loss(logp_c, logp_r, ref_c, ref_r, beta):
    """Sigmoid DPO on summed log-probs. Returns (loss per pair, reward of chosen, reward of rejected)."""
    rewards_c = beta * (logp_c - ref_c)  # implicit reward of a+: beta * [log pi(a+|o) - log pi_ref(a+|o)]
    rewards_r = beta * (logp_r - ref_r)
    return -F.logsigmoid(rewards_c - rewards_r), rewards_c.detach(), rewards_r.detach()  # L_DPO: Bradley-Terry


def nll(logp, n):
    """The per-token mean NLL of a side's agent tokens: lambda's term, and the whole loss of rejection fine-tuning
    and of the embedded warm-up (--mode sft)."""
    return -logp / n.clamp(min=1)


def policy_loss(logp_c, logp_r, ref_c, ref_r, n_c, beta, nll_coef):
    """L_policy = L_DPO + lambda * NLL(a+) for one pair (turn-level, or multi-turn: every turn's tokens summed).
    L_DPO compares log-probs summed over each side's tokens; the NLL is a per-token mean of the chosen side, so
    lambda weighs it alike whatever the turn's length. Returns (loss, reward of chosen, of rejected, nll)."""
    l_dpo, r_c, r_r = dpo_loss(logp_c, logp_r, ref_c, ref_r, beta)
    nll_c = nll(logp_c, n_c)
    return l_dpo + nll_coef * nll_c, r_c, r_r, nll_c.detach()
# ===============================================================================================


def snapshot_schedule(num_steps, n):
    """The steps after which --snapshots N saves the policy: N evenly spaced, before the last step."""
    return sorted({round(num_steps * i / (n + 1)) for i in range(1, n + 1)} - {0, num_steps})


def build_examples(args):
    """Each example: {'chosen': turns, 'rejected': turns} (DPO) or {'chosen': turns} (sft)."""
    if args.mode == "turn":
        rows = common.read_jsonl(args.pairs)
        for line, r in rows:
            for f in ("prompt", "chosen", "rejected"):
                if not isinstance(r.get(f), str):
                    raise common.DataError(f"{args.pairs}:{line}: '{f}' must be a string "
                                           f"(expected label_turns.py output)")
        return [{"prompt": r["prompt"], "chosen": [(r["prompt"], r["chosen"])],
                 "rejected": [(r["prompt"], r["rejected"])]} for _, r in rows]
    graded = colbench.load_graded(args.trajectories)
    if args.mode == "trajectory":
        return [{"chosen": colbench.agent_turns(c), "rejected": colbench.agent_turns(r)}
                for c, r in colbench.trajectory_pairs(graded, args.task_type)]
    if args.task_type == "html" and args.sft_on == "success" and not all("success" in r for r in graded):
        best = {}  # ColBench pages have no notion of success (procedural ones: exact design): each task's best sample
        for r in graded:
            if r["task_id"] not in best or r["reward"] > best[r["task_id"]]["reward"]:
                best[r["task_id"]] = r
        return [{"chosen": colbench.agent_turns(r)} for r in best.values()]
    keep = lambda r: args.sft_on == "all" or r.get("success", r["reward"] >= 1.0)
    return [{"chosen": colbench.agent_turns(r)} for r in graded if keep(r)]


def main(args):
    sequences = args.mode in ("trajectory", "sft")
    common.refuse(args.mode not in ("turn", "trajectory", "sft")
                  and f"--mode {args.mode}: choose turn, trajectory or sft",
                  args.mode == "turn" and not args.pairs and "--mode turn needs --pairs (label_turns.py output)",
                  sequences and not args.trajectories and f"--mode {args.mode} needs --trajectories",
                  args.mode == "turn" and args.trajectories and "--trajectories is for --mode trajectory/sft",
                  args.mode != "turn" and args.pairs and "--pairs is for --mode turn",
                  args.sft_on not in ("success", "all") and f"--sft_on {args.sft_on}: choose success or all",
                  args.nll_coef < 0 and "--nll_coef must be >= 0", args.steps < 0 and "--steps must be >= 0",
                  *training.argument_problems(args))
    rank, world, device, tok = training.setup(args)
    examples = build_examples(args)
    if not examples:
        sys.exit(f"no training examples for --mode {args.mode} (no pairs / no successful trajectories)")
    if rank == 0:
        print(f"{len(examples)} examples for --mode {args.mode}", flush=True)
    for ex in examples:  # tokenise once
        for side in ("chosen", "rejected"):
            if side in ex:
                ex[side + "_seqs"] = common.tokenize_turns(tok, ex[side], max_len=args.max_len)
    common.extra_rows([ex[side] for ex in examples for side in ("chosen_seqs", "rejected_seqs") if side in ex], rank)
    longest = max(training.padded_tokens(*(ex[side + "_seqs"] for side in ("chosen", "rejected") if side in ex))
                  for ex in examples)
    model, ckpt = training.trainer_model(args, longest, world, device)
    if args.mode == "turn" and not ckpt:  # the fast path needs a KV cache, so no checkpointing:
        for ex in examples:  # (prompt ids, [chosen ids, rejected ids]), the prompt run once per pair
            turns = [ex["chosen"][0][1], ex["rejected"][0][1]]
            ex["shared"] = common.encode_shared(tok, "", ex["prompt"], turns, args.max_len)

    def summed_logp(m, seqs, n_turns):  # log pi(a|o) and the tokens, summed over the turns
        return [x.sum() for x in common.turn_logprobs(m, [(seqs, n_turns)])[0]]

    def forwards(ex):
        """The forwards loss_fn (and pi_ref's log-probs) run on one example."""
        if "shared" in ex:
            return training.shared_forwards(ex["shared"][1])
        return training.seq_forwards(*(ex[side + "_seqs"] for side in ("chosen", "rejected") if side + "_seqs" in ex))

    def pair_logps(m, ex):
        """logp(a+), logp(a-) (summed over turns), tokens of a+, and tokens forwarded, for one pair."""
        if "shared" in ex:
            prompt_ids, turns = ex["shared"]
            sums, counts = common.shared_prompt_logprobs(m, prompt_ids, turns)
            return sums[0], sums[1], counts[0], len(prompt_ids) + sum(map(len, turns))
        (logp_c, n_c), (logp_r, _) = ((total.sum(), count.sum()) for total, count in common.turn_logprobs(
            m, [(ex[side + "_seqs"], len(ex[side])) for side in ("chosen", "rejected")]))  # one forward for the pair
        return logp_c, logp_r, n_c, sum(len(s[0]) for s in ex["chosen_seqs"] + ex["rejected_seqs"])

    if args.mode != "sft":  # pi_ref's log-probs of both sides
        ref_fn = lambda m, ex: [x.item() for x in pair_logps(m, ex)[:2]]
        content = lambda ex: ex.get("shared") or [ex["chosen_seqs"], ex["rejected_seqs"]]
        for ex, (c, r) in zip(examples, training.reference_logprobs(model, examples, ref_fn, forwards, args, device,
                                                                    content)):
            ex["ref_chosen"], ex["ref_rejected"] = c, r

    def sft_example_loss(m, ex):
        """The loss of one dialogue (sft mode), and its metrics."""
        loss = nll(*summed_logp(m, ex["chosen_seqs"], len(ex["chosen"])))
        return loss, {"loss": loss.detach(), "nll": loss.detach(), "tokens": sum(len(s[0]) for s in ex["chosen_seqs"])}

    def dpo_pair_loss(m, ex):
        """The loss of one pair (turn or trajectory), and its metrics with TRL's names."""
        logp_c, logp_r, n_c, tokens = pair_logps(m, ex)
        ref_c, ref_r = (torch.tensor(ex[k], device=device) for k in ("ref_chosen", "ref_rejected"))
        loss, r_c, r_r, nll_c = policy_loss(logp_c, logp_r, ref_c, ref_r, n_c, args.beta, args.nll_coef)
        return loss, {"loss": loss.detach(), "rewards/chosen": r_c, "rewards/rejected": r_r,
                      "rewards/margins": r_c - r_r, "rewards/accuracies": (r_c > r_r).float(),
                      "nll": nll_c, "tokens": tokens}  # tensors: no host sync

    loss_fn = sft_example_loss if args.mode == "sft" else dpo_pair_loss
    keys = ["loss", "nll", "tokens"] + (["rewards/chosen", "rewards/rejected", "rewards/margins",
                                         "rewards/accuracies"] if args.mode != "sft" else [])  # summed over ranks
    out = Path(args.output_dir)
    settings = lambda step, steps: SimpleNamespace(**{**vars(args), "steps": steps, "step": step})  # run_settings

    def snapshot(step, steps):  # --snapshots: the policy at evenly spaced steps before the last
        if step in snapshot_schedule(steps, args.snapshots) and not (out / f"step-{step}" / "config.json").exists():
            training.save_checkpoint(model, tok, out / f"step-{step}", rank, settings(step, steps),
                                     getattr(torch, args.save_dtype))

    _, steps = training.train(model, args, examples, loss_fn, forwards, keys, after_step=snapshot)
    training.save_checkpoint(model, tok, args.output_dir, rank, settings(steps, steps), getattr(torch, args.save_dtype))


if __name__ == "__main__":
    common.run(main, Args, __doc__)
