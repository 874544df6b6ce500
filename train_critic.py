"""Train SWEET-RL's asymmetric critic with a Bradley-Terry objective over trajectory pairs.

Reads:  graded trajectories JSONL (evaluate.py output, or the public offline set graded).
Writes: an HF checkpoint of the critic in --output_dir, run_settings.json (label_turns.py reads
        it: pi_ref, beta, whether the critic sees c), log.jsonl and final_metrics.json.

    python train_critic.py --trajectories runs/train_graded.jsonl --model embedded --output_dir runs/critic
    torchrun --nproc_per_node 8 train_critic.py ... --grad_ckpt       # FSDP2, same arguments

The critic is a causal LM initialised from the policy (pi_ref); it reads the training-time
information c (the reference solution) before the dialogue. For agent turn t (the paper, arXiv
2503.15478, Sec. 4):
    A(o_t, a_t, c) = beta * mean over the turn's tokens of [log pi_critic - log pi_ref]
    L_critic = -log sigmoid( sum_t A(o_t+, a_t+, c) - sum_t A(o_t-, a_t-, c) )
Pairs: per task the best sample must succeed; every lower-reward sample is a rejected partner.
Logged: loss, acc (share of pairs scored in the right order), margin, and heldout_* the same on the
pairs of 10% of the tasks, never trained on.
"""
from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import colbench
import common
from machinery import models, training


@dataclass(kw_only=True)
class Args(training.TrainerArgs):
    trajectories: str
    """graded trajectories JSONL (evaluate.py output)"""
    output_dir: str
    """where to save the critic (HF checkpoint)"""
    epochs: int = 4
    """passes over the pairs (released: 4)"""
    max_len: int = 8192
    """longest token sequence; a longer one keeps c whole and the last tokens of the dialogue"""
    normalization: str = "turn"
    """turn: sum of per-turn mean log-ratios (paper) | trajectory: one mean over all agent tokens (released code)"""
    ranking: str = "paper"
    """how label_turns.py ranks a state's candidate turns: paper (equation 3: log pi_critic - log pi_ref, both given
    c) | released (the release's rank_best_of_n: log pi_critic given c minus the sampler's log-prob given o alone,
    which adds pi_ref's pointwise mutual information of c and the turn)"""
    no_training_info: bool = False
    """ablation: the critic does not see the ground truth"""
    heldout_fraction: float = 0.1
    """share of tasks whose pairs are held out for evaluation"""
    train_metrics: bool = False
    """at the end, also score every train pair (a forward pass over all of them) into final_metrics.json"""


HELDOUT_SAMPLE, HELDOUT_EVERY = 32, 20  # held-out pairs logged every 20 steps (~7% of the forwards); at the end all


def training_info(task, no_training_info=False):
    """c, the critic's view of the training-time information: the reference solution, before the
    dialogue (never shown to the policy). The no-information ablation sees nothing."""
    if no_training_info:
        return ""
    return f"Reference solution (training-time information, hidden from the agent):\n{task['ground_truth']}\n\n"


# ================================ CRITIC SCORE AND LOSS ========================================
# A critic variant (another normalisation, a value head, an LLM judge...) is an edit of this block:
# label_turns.py ranks candidate turns with turn_advantage, so training and labelling stay in step.
# Inputs are per-turn sums of agent-token log-probs under the critic and under pi_ref (both given
# c + o_t; with --ranking released, pi_ref given o_t alone when ranking), and each turn's token count,
# as common.turn_logprobs returns them: [n_turns] each. The released code's two forms are choices here:
# --normalization trajectory (its critic's score) and --ranking released (its ranking's baseline).
def turn_advantage(logp_sum, ref_sum, count, beta):
    """A(o_t, a_t, c) = beta * mean over a_t's tokens of [log pi_critic - log pi_ref]: [n_turns]."""
    return beta * (logp_sum - ref_sum) / count.clamp(min=1)


def trajectory_score(logp_sum, ref_sum, count, beta, normalization="turn"):
    """Score of one trajectory: the sum of its turn advantages (paper), or one mean over all its agent
    tokens (released code). Turns with no tokens left after truncation add 0."""
    if normalization == "turn":
        return turn_advantage(logp_sum, ref_sum, count, beta).sum()  # sum_t A(o_t, a_t, c)
    return beta * (logp_sum.sum() - ref_sum.sum()) / count.sum().clamp(min=1)


def critic_loss(score_chosen, score_rejected):
    """Bradley-Terry over a trajectory pair: L_critic = -log sigmoid(S(tau+) - S(tau-))."""
    return -F.logsigmoid(score_chosen - score_rejected)


# The same A, as the stages after training read it (label_turns.py ranks candidates by it; view.py colours
# turns by it). settings: the critic's run_settings.json (beta, no_training_info, ranking).
def ranking_prefix(task, settings):
    """What pi_ref reads before o_t when ranking: c, as the critic does (paper), or nothing (released: the sampler)."""
    released = settings.get("ranking", "paper") == "released"
    return "" if released else training_info(task, settings.get("no_training_info", False))


def candidate_advantages(critic, ref, tok, settings, task, prompt, candidates, max_len, max_tokens=None):
    """A(o_t, a, c) of each candidate turn a at one state o_t (the stored prompt): [N]."""
    prefix = training_info(task, settings.get("no_training_info", False))
    prompt_ids, cand_ids = common.encode_shared(tok, prefix, prompt, candidates, max_len)
    logp_sum, count = common.shared_prompt_logprobs(critic, prompt_ids, cand_ids, max_tokens=max_tokens)  # fast path
    ref_prefix = ranking_prefix(task, settings)
    if ref_prefix != prefix:  # --ranking released: pi_ref reads o_t without c
        prompt_ids, _ = common.encode_shared(tok, ref_prefix, prompt, candidates, max_len)
    ref_sum, _ = common.shared_prompt_logprobs(ref, prompt_ids, cand_ids, max_tokens=max_tokens)
    return turn_advantage(logp_sum, ref_sum, count, settings["beta"])


def dialogue_advantages(critic, ref, tok, settings, traj, max_len):
    """A(o_t, a_t, c) of every agent turn of one trajectory: [n_turns] (0 for a turn cut off by max_len)."""
    turns = colbench.agent_turns(traj)
    prefix = training_info(traj["task"], settings.get("no_training_info", False))
    seqs = common.tokenize_turns(tok, turns, prefix, max_len)
    logp_sum, count = common.turn_logprobs(critic, [(seqs, len(turns))])[0]
    ref_seqs = common.tokenize_turns(tok, turns, ranking_prefix(traj["task"], settings), max_len)
    ref_sum, ref_count = common.turn_logprobs(ref, [(ref_seqs, len(turns))])[0]
    return turn_advantage(logp_sum, ref_sum, count, settings["beta"]) * (count == ref_count)
# ===============================================================================================


def load_critic(critic_dir):
    """(run_settings of a train_critic.py output, its pi_ref's name). A relative pi_ref path is read from the
    directory the critic was trained in."""
    path = Path(critic_dir) / "run_settings.json"
    common.refuse(not path.exists()
                  and f"critic {critic_dir}: no run_settings.json (expected a train_critic.py output directory)")
    settings = json.loads(path.read_text())
    return settings, models.named_model(settings["model"], settings)


def main(args):
    common.refuse(args.normalization not in ("turn", "trajectory") and "--normalization: choose turn or trajectory",
                  args.ranking not in ("paper", "released") and "--ranking: choose paper or released",
                  *training.argument_problems(args),
                  not 0 <= args.heldout_fraction < 1 and "--heldout_fraction must be in [0, 1)")
    rank, world, device, tok = training.setup(args)
    pairs = colbench.trajectory_pairs(colbench.load_graded(args.trajectories), args.task_type)
    if not pairs:
        sys.exit(f"{args.trajectories}: no trajectory pairs (need tasks whose best sample succeeds and another "
                 f"sample with a lower reward; roll out more samples per task)")
    # trajectories used by some pair, tokenised once with c before the dialogue
    trajs = list({id(t): t for pair in pairs for t in pair}.values())
    for t in trajs:
        t["turns"] = colbench.agent_turns(t)
        prefix = training_info(t["task"], args.no_training_info)
        t["seqs"] = common.tokenize_turns(tok, t["turns"], prefix, args.max_len)
    common.extra_rows([t["seqs"] for t in trajs], rank)
    # hold out the pairs of 10% of the tasks
    task_ids = sorted({c["task_id"] for c, _ in pairs})
    random.Random(args.seed).shuffle(task_ids)
    n_held = int(round(args.heldout_fraction * len(task_ids))) if len(task_ids) > 1 else 0
    held = set(task_ids[:n_held])
    train_pairs = [p for p in pairs if p[0]["task_id"] not in held]
    held_pairs = [p for p in pairs if p[0]["task_id"] in held]
    held_sample = random.Random(args.seed).sample(held_pairs, min(HELDOUT_SAMPLE, len(held_pairs)))
    if rank == 0:
        print(f"{len(pairs)} pairs from {len(task_ids)} tasks: {len(train_pairs)} train, {len(held_pairs)} held out",
              flush=True)

    longest = max(training.padded_tokens(*(t["seqs"] for t in pair)) for pair in pairs)
    critic, _ = training.trainer_model(args, longest, world, device)
    ref_fn = lambda m, t: common.turn_logprobs(m, [(t["seqs"], len(t["turns"]))])[0][0].tolist()  # pi_ref's sums
    forwards = lambda t: training.seq_forwards(t["seqs"])
    for t, ref_sum in zip(trajs, training.reference_logprobs(critic, trajs, ref_fn, forwards, args, device,
                                                             lambda t: t["seqs"])):
        t["ref_sum"] = ref_sum

    def scores(m, pair):
        """S(tau+), S(tau-): the critic's score of each trajectory of a pair (equation 2's argument), in one forward."""
        return [trajectory_score(logp_sum, torch.tensor(t["ref_sum"], device=logp_sum.device), count, args.beta,
                                 args.normalization)
                for t, (logp_sum, count) in zip(pair, common.turn_logprobs(
                    m, [(t["seqs"], len(t["turns"])) for t in pair]))]

    def pair_loss(m, pair):
        """The loss of one pair (chosen, rejected), and its metrics."""
        s_c, s_r = scores(m, pair)
        loss, diff = critic_loss(s_c, s_r), (s_c - s_r).detach()
        return loss, {"loss": loss.detach(), "acc": (diff > 0).float(), "margin": diff,
                      "tokens": sum(len(s[0]) for t in pair for s in t["seqs"])}  # tensors: no host sync

    def pair_forwards(pair):
        return training.seq_forwards(*(t["seqs"] for t in pair))

    def pair_metrics(name, eval_pairs):
        """loss, acc and margin of the current critic on eval_pairs, without grad."""
        if not eval_pairs:
            return {}
        critic.eval()
        def margin(m, pair):
            s_c, s_r = scores(m, pair)
            return (s_c - s_r).item()
        margins = training.precompute(critic, eval_pairs, margin, rank, world, pair_forwards, f"{name} pairs")
        margins = torch.tensor(margins)
        critic.train()
        return {f"{name}_loss": critic_loss(margins, 0).mean().item(),
                f"{name}_acc": (margins > 0).float().mean().item(), f"{name}_margin": margins.mean().item()}

    def heldout(step):  # every HELDOUT_EVERY steps: a fixed sample of the held-out pairs
        if not (step % HELDOUT_EVERY == 0 and held_pairs):
            return {}
        t1 = time.time()
        return {**pair_metrics("heldout", held_sample), "heldout_seconds": time.time() - t1}

    log, _ = training.train(critic, args, train_pairs, pair_loss, pair_forwards, ["loss", "acc", "margin", "tokens"],
                            extra=heldout)
    final = {**(pair_metrics("train", train_pairs) if args.train_metrics else {}),
             **pair_metrics("heldout", held_pairs)}
    if rank == 0:
        print("final " + " ".join(f"{k}={v:.4g}" for k, v in final.items()), flush=True)
        common.write_text(Path(args.output_dir) / "final_metrics.json",
                          json.dumps({"steps": len(log.history), **final}, indent=2))
    training.save_checkpoint(critic, tok, args.output_dir, rank, args, getattr(torch, args.save_dtype))


if __name__ == "__main__":
    common.run(main, Args, __doc__)
