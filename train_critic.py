"""Train SWEET-RL's asymmetric critic with a Bradley-Terry objective over trajectory pairs.

Reads:  graded trajectories JSONL (evaluate.py output, or the public offline set graded).
Writes: an HF checkpoint of the critic in --output_dir, run_settings.json (label_turns.py reads
        it: pi_ref, beta, whether the critic sees the training-time information) and log.jsonl.

    python train_critic.py --trajectories runs/train_graded.jsonl --model embedded --output_dir runs/critic
    torchrun --nproc_per_node 8 train_critic.py ... --grad_ckpt       # FSDP2, same arguments

The critic is a causal LM initialised from the policy (pi_ref); it reads the training-time
information c (the ground truth) before the dialogue. For agent turn t (the paper, arXiv 2503.15478, Sec. 4):
    A(o_t, a_t, c) = beta * mean over the turn's tokens of [log pi_critic - log pi_ref]
    L_critic = -log sigmoid( sum_t A(o_t+, a_t+, c) - sum_t A(o_t-, a_t-, c) )
Pairs: per task the best sample must succeed; every lower-reward sample is a rejected partner.

Logged: loss; acc = share of pairs whose chosen score is higher; margin = score(chosen) -
score(rejected); heldout_* the same on 10% of the tasks' pairs (held out, never trained on);
tokens_per_s. final_metrics.json: the held-out pairs after training (+ every train pair with
--train_metrics).

Deviations from the paper / released code:
1. `--normalization trajectory` reproduces the released code: one mean over all agent tokens of
   the trajectory instead of the sum of per-turn means (`turn`, the default, is the paper's).
2. pi_ref's log-probs are computed once before training (it is frozen), not at every step; with
   --train_layers, so is the frozen layers' output (--keep_frozen).
3. c is a plain-text block before the first stored prompt (the stored prompt is used as is).
4. `--fewer_turns` (ours, off by default): two successes of a task also make a pair, the shorter
   dialogue chosen (colbench.trajectory_pairs).
5. `--pair_facts` (ours, off by default): html samples ranked by design facts right, then similarity
   (colbench.trajectory_pairs).
6. `--extra_trajectories` (ours, off by default): more dialogues of the train tasks join the pairs, e.g. run.sh's
   CRITIC_CONTRAST scripted ones (a hasty answer, a dialogue that never stops asking): off-policy data the
   critic learns from and labelling never samples states of.
7. `--training_info facts` (ours, off by default): c is the human's hidden lines, then the reference solution.
8. `--decision_terms` (ours, off by default): each turn's first line is a term of the score of its own,
   S(tau) = sum_t [A(first line of a_t) + A(rest of a_t)] (decision_terms below).
9. `--shortcuts N` (ours, off by default): a success is also paired against copies of itself that answer
   1..N turns sooner, each copy chosen (colbench.trajectory_pairs).
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
import models


@dataclass
class Args:
    trajectories: str
    """graded trajectories JSONL (evaluate.py output)"""
    output_dir: str
    """where to save the critic (HF checkpoint)"""
    extra_trajectories: str = ""
    """more graded dialogues of the same tasks, paired with those above (e.g. scripted contrasts: run.sh's
    CRITIC_CONTRAST; label_turns.py never sees them)"""
    model: str = "embedded"
    """the critic's starting point and pi_ref: the policy (HF path or id)"""
    task_type: str = "code"
    """code | html (decides how pairs are built)"""
    beta: float = 0.1
    """scale of the log-ratio advantage"""
    lr: float = 2e-7
    """AdamW learning rate (released: 2e-7 for 8B)"""
    epochs: int = 4
    """passes over the pairs (released: 4)"""
    batch_size: int = 8
    """pairs per optimizer step, over all ranks"""
    max_len: int = 8192
    """longest token sequence; a longer one keeps c whole and the last tokens of the dialogue"""
    normalization: str = "turn"
    """turn: sum of per-turn mean log-ratios (paper) | trajectory: one mean over all agent tokens (released code)"""
    no_training_info: bool = False
    """ablation: the critic does not see the ground truth"""
    decision_terms: bool = False
    """each agent turn's first line ("I WANT TO ANSWER:", a draft's opening line; a one-line turn whole) is a term of
    the trajectory score of its own, beside the rest of the turn (ours): the term label_turns --cross_kind decision
    ranks candidates by first"""
    training_info: str = "reference"
    """what c is: reference (the reference solution, the paper's) | facts (the human's hidden lines, then the
    reference solution; ours, for tasks with hidden_information)"""
    heldout_fraction: float = 0.1
    """share of tasks whose pairs are held out for evaluation"""
    eval_every: int = 5
    """log the held-out pairs' loss/acc/margin every N steps (0 = only at the end)"""
    train_metrics: bool = False
    """at the end, also score every train pair (a forward pass over all of them) into final_metrics.json"""
    train_layers: int = 0
    """train only the top N decoder layers (+ final norm; 0 = all): a cheaper backward on CPU"""
    dtype: str = "auto"
    """compute dtype: auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float32. The weights the optimizer
    updates stay fp32 (mixed precision): a bf16 weight would round a 2e-7 step away"""
    save_dtype: str = "float32"
    """float32 (the trained weights as they are) | bfloat16 (half the size, for serving: a weight whose
    whole update is below half a bf16 step rounds back to its starting value)"""
    grad_ckpt: bool = False
    """activation checkpointing (implies --no_shared_prefix)"""
    shared_prefix: bool = True
    """run a pair's common prefix (c + the first prompt) once, then each rest on its KV cache
    (same loss and gradients as running each trajectory whole; --no_shared_prefix does that)"""
    fewer_turns: bool = False
    """also pair two successes of a task (html: exact designs), the one with fewer agent turns chosen"""
    shortcuts: int = 0
    """also pair each success that answered after several agent turns against up to N copies that give the same
    answer 1..N turns sooner, each copy chosen (ours; colbench.trajectory_pairs; 0 = off)"""
    pair_facts: bool = False
    """html on procedural pages: the sample with more design facts right is chosen whatever the similarities,
    as many right pair by similarity (needs evaluate.py's facts_right)"""
    group_by_task: bool = False
    """lay each task's pairs side by side in the batches and score a trajectory once per step for all its
    pairs (a micro-batch = one task's pairs: ~2x fewer passes on html's pairs, the same loss for the same
    batch; memory holds a task's trajectories, not two). Off: the pairs shuffled, one per micro-batch"""
    keep_frozen: bool = True
    """with --train_layers, keep the frozen layers' output for each trajectory from pi_ref's pass, and run
    only the trained layers at each step (common.FrozenBottom: same scores; one process, no --grad_ckpt)"""
    save_every: int = 50
    """save the training state (model + optimizer) every N steps to OUTPUT_DIR/resume (0 = never)"""
    resume: bool = False
    """continue from OUTPUT_DIR/resume (same --batch_size, --seed, --epochs) instead of starting over"""
    seed: int = 0
    """data order and held-out split"""


def training_info(task, no_training_info=False, kind="reference"):
    """The critic's view of c: the reference solution (kind facts: after the human's hidden lines), before the
    dialogue (never shown to the policy)."""
    if no_training_info:
        return ""
    facts = task.get("hidden_information", "").strip() if kind == "facts" else ""
    reference = f"Reference solution (training-time information, hidden from the agent):\n{task['ground_truth']}\n\n"
    return (f"What the human knows and has not said:\n{facts}\n\n" if facts else "") + reference


# ================================ CRITIC SCORE AND LOSS ========================================
# A critic variant (another normalisation, a value head, an LLM judge...) is an edit of this block:
# label_turns.py ranks candidate turns with turn_advantage, so training and labelling stay in step.
# Inputs are per-turn sums of agent-token log-probs under the critic and under pi_ref (both given
# c + o_t), and each turn's token count, as common.turn_logprobs returns them: [n_turns] each.
def turn_advantage(logp_sum, ref_sum, count, beta):
    """A(o_t, a_t, c) = beta * mean over a_t's tokens of [log pi_critic - log pi_ref]: [n_turns]."""
    return beta * (logp_sum - ref_sum) / count.clamp(min=1)


def trajectory_score(logp_sum, ref_sum, count, beta, normalization="turn"):
    """Score of one trajectory: the sum of its turn advantages (paper), or one mean over all its agent
    tokens (released code). Turns with no tokens left after truncation add 0."""
    if normalization == "turn":
        return turn_advantage(logp_sum, ref_sum, count, beta).sum()  # sum_t A(o_t, a_t, c)
    return beta * (logp_sum.sum() - ref_sum.sum()) / count.sum().clamp(min=1)


def decision_terms(tok, turns, seqs):
    """--decision_terms: each turn's first line (common.first_line_tokens: its decision) moves from per-turn index t
    to n + t, so that over the [2n] per-turn sums turn_advantage gives A(first line of a_t) at n + t and A(rest of
    a_t) at t, and trajectory_score sums both: S(tau) = sum_t [A(first line) + A(rest)]. A one-line turn is all
    first line (its rest has no tokens and adds 0); a turn that max_len cut at its start stays whole. Returns
    (seqs, 2n), the arguments of common.turn_logprobs."""
    n, out = len(turns), []
    for ids, turn_of in seqs:
        turn_of = list(turn_of)
        for t, (_, text) in enumerate(turns):
            pos = [i for i, k in enumerate(turn_of) if k == t]
            if pos and len(pos) == len(tok(text, add_special_tokens=False)["input_ids"]) + 1:  # whole: text + end of turn
                for i in pos[:common.first_line_tokens(tok, text, len(pos))]:
                    turn_of[i] = n + t
        out.append((ids, turn_of))
    return out, 2 * n


def critic_loss(score_chosen, score_rejected):
    return -F.logsigmoid(score_chosen - score_rejected)  # L_critic = -log sigmoid(S(tau+) - S(tau-))
# ===============================================================================================


def main(args):
    common.refuse(args.normalization not in ("turn", "trajectory") and "--normalization: choose turn or trajectory",
                  args.task_type not in ("code", "html") and f"--task_type {args.task_type}: choose code or html",
                  args.training_info not in ("reference", "facts") and f"--training_info {args.training_info}: choose reference or facts",
                  args.decision_terms and args.normalization != "turn"
                  and "--decision_terms adds per-turn terms: use it with --normalization turn",
                  args.pair_facts and args.task_type != "html" and "--pair_facts ranks html pages: use it with --task_type html",
                  args.beta <= 0 and "--beta must be positive", args.lr <= 0 and "--lr must be positive",
                  args.epochs < 1 and "--epochs must be at least 1", args.batch_size < 1 and "--batch_size must be at least 1",
                  not 0 <= args.heldout_fraction < 1 and "--heldout_fraction must be in [0, 1)",
                  args.save_every < 0 and "--save_every must be >= 0",
                  args.shortcuts < 0 and "--shortcuts must be >= 0", *models.precision_problems(args),
                  args.resume and not Path(args.output_dir, "resume").exists() and not Path(args.output_dir, "resume.old").exists()
                  and f"--resume: nothing to resume in {args.output_dir}/resume")
    common.check_writable(args.output_dir.rstrip("/") + "/")
    rank, world, device = common.init_distributed()
    torch.manual_seed(args.seed)
    tok = models.load_tokenizer(args.model)
    graded = [r for path in filter(None, (args.trajectories, args.extra_trajectories))
              for r in colbench.load_graded(path, facts=args.pair_facts)]
    pairs = colbench.trajectory_pairs(graded, args.task_type, fewer_turns=args.fewer_turns, by_facts=args.pair_facts,
                                      shortcuts=args.shortcuts)
    if not pairs:
        sys.exit(f"{args.trajectories}: no trajectory pairs (need tasks whose best sample succeeds and another "
                 f"sample with a lower reward; roll out more samples per task)")
    # trajectories used by some pair, tokenised once with c before the dialogue
    trajs = {id(t): t for pair in pairs for t in pair}
    for t in trajs.values():
        t["turns"] = colbench.agent_turns(t)
        t["seqs"] = common.tokenize_turns(tok, t["turns"], training_info(t["task"], args.no_training_info, args.training_info), args.max_len)
        t["terms"] = len(t["turns"])  # per-turn sums: one per turn, or with --decision_terms two
        if args.decision_terms:
            t["seqs"], t["terms"] = decision_terms(tok, t["turns"], t["seqs"])
    # hold out the pairs of 10% of the tasks
    task_ids = sorted({c["task_id"] for c, _ in pairs})
    random.Random(args.seed).shuffle(task_ids)
    n_held = int(round(args.heldout_fraction * len(task_ids))) if len(task_ids) > 1 else 0
    held = set(task_ids[:n_held])
    train_pairs = [p for p in pairs if p[0]["task_id"] not in held]
    held_pairs = [p for p in pairs if p[0]["task_id"] in held]
    if rank == 0:
        sooner = sum("shortcut_of" in c for c, _ in pairs)
        print(f"{len(pairs)} pairs from {len(task_ids)} tasks: {len(train_pairs)} train, {len(held_pairs)} held out"
              + (f"; {sooner} of them a success against its answer given sooner" if sooner else ""), flush=True)

    critic = common.shard_model(models.load_model(args.model, device, args.grad_ckpt, torch.float32, args.train_layers),
                                world, device, models.compute_dtype(args.dtype, device))
    # the frozen layers' output never changes: kept from pi_ref's pass (under torchrun every rank runs them)
    bottom = (common.FrozenBottom(critic, args.train_layers) if args.keep_frozen and world == 1 and not args.grad_ckpt
              and 0 < args.train_layers < len(critic.get_decoder().layers) else None)

    def turn_logprobs(m, group):
        """Per-turn (sum, count) of agent-token log-probs of trajectories of one task ([terms] each)."""
        if args.shared_prefix and not args.grad_ckpt:  # c + first prompt once (common.shared_prefix_turn_logprobs)
            return common.shared_prefix_turn_logprobs(m, [(t["seqs"], t["terms"]) for t in group], bottom=bottom)
        return [common.turn_logprobs(m, t["seqs"], t["terms"], bottom) for t in group]

    # pi_ref = the starting critic weights: its per-turn log-probs once, before any update (per task)
    groups = {}
    for t in trajs.values():
        groups.setdefault(t["task_id"], []).append(t)
    groups = list(groups.values())
    ref_fn = lambda m, g: [[x.tolist() for x in r] for r in turn_logprobs(m, g)]
    for g, results in zip(groups, common.precompute(critic, groups, ref_fn, rank, world)):
        for t, (s, c) in zip(g, results):
            t["ref_sum"], t["ref_count"] = s, c

    def scores(m, group):
        """score(tau) of each trajectory of a group (one task's)."""
        logps = turn_logprobs(m, group)
        return [trajectory_score(logp_sum, torch.tensor(t["ref_sum"], device=logp_sum.device), count, args.beta,
                                 args.normalization) for t, (logp_sum, count) in zip(group, logps)]

    def micro_batches(pairs):
        """One pair per micro-batch (memory holds one pair's graph), or with --group_by_task one task's
        pairs: each trajectory is then scored once for all its pairs."""
        if not args.group_by_task:
            return [[pair] for pair in pairs]
        by_task = {}
        for pair in pairs:
            by_task.setdefault(pair[0]["task_id"], []).append(pair)
        return list(by_task.values())

    def pair_scores(m, micro):
        """([score of each chosen], [score of each rejected]) of a micro-batch's pairs, and its trajectories."""
        trajs = list({id(t): t for pair in micro for t in pair}.values())
        score = dict(zip(map(id, trajs), scores(m, trajs)))
        return [torch.stack([score[id(pair[k])] for pair in micro]) for k in (0, 1)], trajs

    def pairs_loss(m, micro):
        """Summed loss of a micro-batch's pairs, and its metrics."""
        (s_c, s_r), trajs = pair_scores(m, micro)
        loss, diffs = critic_loss(s_c, s_r).sum(), (s_c - s_r).detach()
        return loss, {"n": len(micro), "loss": loss.item(), "acc": (diffs > 0).sum().item(), "margin": diffs.sum().item(),
                      "tokens": sum(len(s[0]) for t in trajs for s in t["seqs"])}

    def pair_metrics(name, eval_pairs):
        """loss, acc and margin of the current critic on eval_pairs, without grad."""
        if not eval_pairs:
            return {}
        critic.eval()
        margin = lambda m, micro: [(s_c - s_r).item() for s_c, s_r in zip(*pair_scores(m, micro)[0])]
        margins = torch.tensor([x for r in common.precompute(critic, micro_batches(eval_pairs), margin, rank, world,
                                                             desc=f"{name} pairs") for x in r])
        critic.train()
        return {f"{name}_loss": F.softplus(-margins).mean().item(), f"{name}_acc": (margins > 0).float().mean().item(),
                f"{name}_margin": margins.mean().item()}

    # ------------------------------------ the training loop ---------------------------------------
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    critic.train()
    opt = torch.optim.AdamW([p for p in critic.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    order = {"batch_size": args.batch_size, "seed": args.seed, "epochs": args.epochs,  # what the data order depends on
             **({"group_by_task": True} if args.group_by_task else {})}
    start = common.load_training_state(critic, opt, out / "resume", order) if args.resume else 0
    log = common.TrainingLog(out, start, rank)
    batches = common.batch_order(len(train_pairs), args.batch_size, args.epochs, args.seed,
                                 [c["task_id"] for c, _ in train_pairs] if args.group_by_task else None)
    for step, (epoch, batch) in enumerate(batches, 1):
        if step <= start:
            continue  # done before the restart
        t0, sums = time.time(), {"n": 0}
        local = [train_pairs[i] for i in batch[rank * len(batch) // world:(rank + 1) * len(batch) // world]]  # this rank's share
        micro = micro_batches(local)
        n_micro = common.lockstep(len(micro))
        for j in range(n_micro):
            loss = None
            if j < len(micro):
                loss, metrics = pairs_loss(critic, micro[j])
                loss = loss / len(batch)  # the step's gradient is the mean over the global batch
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0) + v
            common.backward(critic, loss, world, last=j == n_micro - 1)
        grad_norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.time() - t0
        held = pair_metrics("heldout", held_pairs) if args.eval_every and step % args.eval_every == 0 else {}
        log.write(common.step_line(step, epoch, common.all_reduce_dict(sums), grad_norm, seconds, held))
        if args.save_every and step % args.save_every == 0 and step < len(batches):
            common.save_training_state(critic, opt, out / "resume", step, order, rank)

    final = {**(pair_metrics("train", train_pairs) if args.train_metrics else {}), **pair_metrics("heldout", held_pairs)}
    if rank == 0:
        print("final " + " ".join(f"{k}={v:.4g}" for k, v in final.items()), flush=True)
        common.write_text(out / "final_metrics.json", json.dumps({"steps": len(log.history), **final}, indent=2))
    common.save_checkpoint(critic, tok, args.output_dir, rank, args, getattr(torch, args.save_dtype))
    if rank == 0:
        print(f"saved {args.output_dir}")


if __name__ == "__main__":
    common.run(main, Args, __doc__)
