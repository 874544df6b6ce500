"""Train SWEET-RL's asymmetric critic with a Bradley-Terry objective over trajectory pairs.

Reads:  graded trajectories JSONL (evaluate.py output, or the public offline set graded).
Writes: an HF checkpoint of the critic in --output_dir, run_settings.json (label_turns.py reads
        it: pi_ref, beta, whether the critic sees c), log.jsonl and final_metrics.json.

    python train_critic.py --trajectories runs/train_graded.jsonl --model embedded --output_dir runs/critic
    torchrun --nproc_per_node 8 train_critic.py ... --grad_ckpt       # FSDP2, same arguments

The critic, a causal LM initialised from the policy (pi_ref), reads the training-time information c (the
reference solution) before the dialogue. For agent turn t (the paper, arXiv 2503.15478, Sec. 4):
    A(o_t, a_t, c) = beta * mean over the turn's tokens of [log pi_critic - log pi_ref]
    L_critic = -log sigmoid( sum_t A(o_t+, a_t+, c) - sum_t A(o_t-, a_t-, c) )  + lambda * mean_t A^2
Deviation: the second term (--ridge, 3 by default; 0 is the paper's form) pins where answers stand against questions.
Pairs: per task the best sample must succeed; every lower-reward sample is a rejected partner.
Logged: loss, acc (share of pairs scored in the right order), margin, and heldout_* the same on the
pairs of 10% of the tasks, never trained on.
"""
from __future__ import annotations

import json
import random
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
    """label_turns.py's ranking: paper (equation 3: log pi_critic - log pi_ref, both given c) | released (the
    release's: log pi_critic given c - the sampler's log-prob given o alone, adding pi_ref's PMI of c and a turn)"""
    ridge: float = 3.0
    """lambda of the identifying term (ours): + lambda * mean over a pair's turns of A^2 (0: the paper's equation 2)"""
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
# The whole critic; main() only calls it. turn_advantage reads A off per-turn log-prob sums (common.turn_logprobs),
# critic_loss makes a pair's loss from both dialogues' per-turn advantages; labelling and the viewer read A through
# candidate_advantages and dialogue_advantages below. A ridge, a centring term or another pairing of turns is an edit
# of critic_loss alone; a value head is this block (A from the head) plus how the critic is loaded (training's
# trainer_model, models.load_model). The release's two forms: --normalization trajectory, --ranking released.
def turn_advantage(logp_sum, ref_sum, count, beta):
    """A(o_t, a_t, c) = beta * mean over a_t's tokens of [log pi_critic - log pi_ref]: [n_turns]."""
    return beta * (logp_sum - ref_sum) / count.clamp(min=1)


def trajectory_score(advantage, count, normalization="turn"):
    """S(tau) from its turns' advantages and token counts ([n_turns] each): their sum (paper), or one mean over all
    its agent tokens (released code: each turn weighted by its tokens). A turn cut off by truncation adds 0."""
    if normalization == "turn":
        return advantage.sum()  # sum_t A(o_t, a_t, c)
    return (advantage * count).sum() / count.sum().clamp(min=1)


def critic_loss(chosen, rejected, args):
    """(loss, margin S(tau+) - S(tau-)) of a pair; chosen, rejected: each dialogue's (A, token count), [n_turns] each.
    Both dialogues end in one answer, so equation 2 leaves free a constant added to every answer's A (where an answer
    stands against a question); --ridge lambda adds lambda * mean of A^2 over the pair's turns, which pins it."""
    margin = trajectory_score(*chosen, args.normalization) - trajectory_score(*rejected, args.normalization)
    loss = -F.logsigmoid(margin)  # equation 2: L_critic = -log sigmoid(S(tau+) - S(tau-))
    if args.ridge:
        loss = loss + args.ridge * torch.cat([chosen[0], rejected[0]]).pow(2).mean()
    return loss, margin


# The same A, as the stages after training read it (label_turns.py ranks candidates by it; view.py colours
# turns by it). settings: the critic's run_settings.json (beta, no_training_info, ranking).
def ranking_prefix(task, settings):
    """What pi_ref reads before o_t when ranking: c, as the critic does (paper), or nothing (released: the sampler)."""
    return "" if settings.get("ranking") == "released" else training_info(task, settings.get("no_training_info", False))


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
                  not 0 <= args.heldout_fraction < 1 and "--heldout_fraction must be in [0, 1)",
                  args.ridge < 0 and "--ridge must be >= 0")
    rank, world, device, tok = training.setup(args)
    pairs = colbench.trajectory_pairs(colbench.load_graded(args.trajectories), args.task_type)
    common.refuse(not pairs and f"{args.trajectories}: no trajectory pairs (need tasks whose best sample succeeds and "
                  f"another sample with a lower reward; roll out more samples per task)")
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

    pair_forwards = lambda pair: training.seq_forwards(*(t["seqs"] for t in pair))

    def pair_terms(m, pair):
        """(loss, margin) of one pair (chosen, rejected) from the critic block; both dialogues in one forward."""
        per_turn = []  # (A [n_turns], token count [n_turns]) of the chosen, then the rejected dialogue
        for t, (logp_sum, count) in zip(pair, common.turn_logprobs(m, [(t["seqs"], len(t["turns"])) for t in pair])):
            ref_sum = torch.tensor(t["ref_sum"], device=logp_sum.device)
            per_turn.append((turn_advantage(logp_sum, ref_sum, count, args.beta), count))
        return critic_loss(*per_turn, args)

    def pair_loss(m, pair):
        loss, margin = pair_terms(m, pair)
        return loss, {"loss": loss.detach(), "acc": (margin > 0).float(), "margin": margin.detach(),
                      "tokens": sum(len(s[0]) for t in pair for s in t["seqs"])}  # tensors: no host sync

    def pair_metrics(name, eval_pairs):
        """loss, acc and margin of the current critic on eval_pairs, without grad."""
        if not eval_pairs:
            return {}
        critic.eval()
        terms = lambda m, pair: [v.item() for v in pair_terms(m, pair)]
        losses, margins = torch.tensor(training.precompute(critic, eval_pairs, terms, rank, world, pair_forwards,
                                                           f"{name} pairs")).T
        critic.train()
        return {f"{name}_loss": losses.mean().item(),
                f"{name}_acc": (margins > 0).float().mean().item(), f"{name}_margin": margins.mean().item()}

    def heldout(step):  # every HELDOUT_EVERY steps: a fixed sample of the held-out pairs
        if step % HELDOUT_EVERY or not held_pairs:
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
