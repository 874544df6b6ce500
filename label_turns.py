"""Label turns with the critic: sample candidate turns per state, rank them, write turn-level pairs.

Reads:  graded trajectories JSONL (each stored agent `input` is a state o_t) and the critic from
        train_critic.py (its run_settings.json names pi_ref, and whether it sees c).
Writes: PAIRS JSONL, one pair a line: prompt, chosen, rejected, chosen_advantage,
        rejected_advantage, task_id, sample, turn; and PAIRS.states.jsonl, one labelled state a line
        (all candidates and advantages, and which the token cap cut off; it marks the state done, so a rerun
        resumes).

    python label_turns.py --trajectories runs/train_graded.jsonl --critic runs/critic --output runs/pairs.jsonl
    python label_turns.py ... --agent_backend vllm --policy meta-llama/Llama-3.1-8B-Instruct
    python label_turns.py ... --critic runs/critic+runs/critic_2    # an ensemble: the critics' mean advantage
    torchrun --nproc_per_node 8 label_turns.py ...    # states split over ranks; cat the shard files

For each state o_t (the paper, arXiv 2503.15478, Sec. 4): sample N candidate turns a from the policy; score each with
    advantage(a) = mean over a's tokens of [log pi_critic(a | c, o_t) - log pi_ref(a | c, o_t)]
(pi_ref by its own forward pass, never the sampler's log-probs, whose meaning changes with
temperature and vLLM version). Per state, up to pairs_per_state distinct pairs, each joining a
candidate of the better half by advantage to one of the worse half (the higher one is chosen); the
pairs with the largest advantage gaps are taken first, so the first pair is best against worst.

Sampling is batched: the N candidates of --state_batch states are one batch (hf: each state's
prompt runs once for its N samples, and a finished candidate leaves the batch; models.HFSampler).
Scoring shares work: the prompt (c + o_t) is run once, and the N candidates run on its KV cache in
batches of similar length (common.shared_prompt_logprobs); it equals naive one-by-one scoring
(tests check 1e-4). Critics trained with --train_layers share pi_ref's frozen layers, which then
run once per state for all of them (common.FrozenBottom; --no_keep_frozen runs them in each).

Turn-credit accuracy (procedural code tasks and pages; credit.py, apart from the algorithm): every candidate's
true class is stored in the states file beside every critic's advantages (--critic and
--credit_critics), and PAIRS.credit.json says how often each critic ranks a good turn above a bad one, and
how often an answer above a question or draft where the human had told every hidden fact (`told_all`,
where asking again reveals nothing) and elsewhere: a critic that leans to a kind of turn ranks alike in both.

Deviations from the paper / released code:
1. pi_ref sees the same input as the critic (c + o_t), as in the critic's own objective (the released
   code used the sampler's log-probs, without c).
2. Identical candidates are never paired.
3. The advantage is train_critic.turn_advantage, with the critic's beta (from its run_settings.json).
4. The released code draws each pair at random from the two halves (or takes best against worst);
   here the largest gaps come first. On the states of two embedded runs this kept the number of
   pairs and cut the pairs the true classes call wrong from 22 to 14 and from 7 to 3 (docs/curriculum.md).
5. `--cross_kind decision` (ours; off here, run.sh's html default: LABEL_CROSS_KIND) ranks candidates by the
   advantage of their first line before the whole turn's: a page's mean log-ratio is ~150 tokens the reference
   page predicts, which makes a critic lean to answering or to asking whatever the state; its first line is the
   decision alone.
6. A candidate the token cap (--max_new_tokens) cut off is never chosen over one that ended its turn (ours):
   DPO trains a turn with its end-of-turn token, which the policy never picked there, and a cut page or
   draft is broken, so it teaches the policy to end turns mid-page.
"""
from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import colbench
import common
import models
import credit
from train_critic import training_info, turn_advantage


@dataclass
class Args:
    trajectories: str
    """graded trajectories JSONL: its agent turns' stored inputs are the states"""
    critic: str
    """critic directory from train_critic.py; DIR+DIR+... (the same critic trained with other seeds) is an ensemble:
    a candidate's advantage is the mean of its critics' (run.sh CRITICS)"""
    output: str
    """PAIRS JSONL to write (reruns resume)"""
    policy: str = ""
    """the sampling policy (default: the critic's pi_ref)"""
    num_candidates: int = 16
    """candidate turns sampled per state (N)"""
    pairs_per_state: int = 4
    """pairs drawn per state"""
    data_fraction: float = 1.0
    """share of the trajectories whose states are labelled (released: 0.1)"""
    temperature: float = 1.0
    """candidate sampling temperature"""
    top_p: float = 1.0
    """candidate nucleus sampling"""
    max_new_tokens: int = 1024
    """longest candidate"""
    max_len: int = 16384
    """longest prompt + candidate for scoring; a longer prompt keeps c whole and the last tokens of the dialogue"""
    agent_backend: str = "hf"
    """hf | openai | vllm (how candidates are sampled)"""
    agent_url: str = ""
    """openai backend: server URL"""
    batch_size: int = 16
    """openai backend: concurrent requests"""
    state_batch: int = 8
    """states whose candidates are sampled in one batch (hf: one padded batch of state_batch x N prompts)"""
    max_batch_tokens: int = 65536
    """hf sampling and scoring hold at most this many rows x (prompt + candidate) tokens of KV cache at once
    (sub-batches), so memory stays bounded whatever the candidates and the prompt length (bench/bench_label_memory.py)"""
    seed: int = 0
    """sampling and pair drawing"""
    shard: str = ""
    """i/n: only this shard of the states (default: torchrun RANK/WORLD_SIZE)"""
    credit_critics: str = ""
    """NAME=DIR,...: more critics (variants) that score the same candidates, for the turn-credit accuracy only
    (NAME=DIR+DIR: an ensemble, as --critic)"""
    gpu_memory_utilization: float = 0.5
    """vllm backend: share of the GPU's memory vLLM may take (the critics and pi_ref need the rest)"""
    max_turns: int = 10
    """the rollouts' turn limit (a candidate at the last turn is an answer, for the turn classes)"""
    decode_dtype: str = "auto"
    """hf backend: auto (bf16 weights on a GPU, fp32 on a CPU) | bfloat16 (on a CPU: bf16 matmuls, fp32 weights,
    a bf16 KV cache; ~0.7x a decoding step where the CPU has AVX512-BF16, models.bf16_matmuls, and ~0.8x again on
    long dialogues, models.bf16_kv_attention) | float32"""
    score_dtype: str = "auto"
    """critics and pi_ref scoring the candidates: auto (bf16 weights on a GPU, fp32 on a CPU) | bfloat16 (on a
    CPU: bf16 matmuls, fp32 weights, ~0.7x the scoring time with AVX512-BF16; advantages within ~1e-2 of
    fp32's, models.bf16_matmuls) | float32"""
    cross_kind: str = "turn"
    """turn: candidates ranked by their whole turn's advantage (the paper) | decision: ranked first by the advantage
    of their first line (the decision: the question itself, the answer marker, a draft's opening line), then by the
    whole turn, so a question, a draft and an answer compare by what they decide, not by a page's ~150 tokens (ours;
    run.sh LABEL_CROSS_KIND; docs/frontend.md, "A decision ranked by its first line")"""
    keep_frozen: bool = True
    """critics trained with --train_layers from pi_ref share its frozen layers: run those once per state
    for all of them and pi_ref (common.FrozenBottom; the same advantages)"""


def make_pairs(candidates, advantages, k, rng, decisions=None, cut=None):
    """Up to k distinct pairs: one candidate from the better half and one from the worse half, the
    higher one chosen; identical texts never pair, and no pair of texts repeats. The pairs with the
    largest advantage gaps come first (the critic's surest preferences; ties in random order).
    decisions (--cross_kind decision): each candidate's first-line advantage, which ranks first; the whole
    turn's advantage orders candidates of one first line (e.g. two answers), and the gap is the first that differs.
    cut (the sampler's): candidates the token cap cut off, never chosen over one that ended its turn."""
    key = (lambda i: (decisions[i], advantages[i])) if decisions is not None else (lambda i: (advantages[i],))
    gap = lambda a, b: next((x - y for x, y in zip(key(a), key(b)) if x != y), 0.0)
    order = sorted(range(len(candidates)), key=lambda i: [-x for x in key(i)])
    better, worse = order[: len(order) // 2], order[len(order) // 2:]
    cut = cut or [False] * len(candidates)
    options = [(a, b) for a in better for b in worse
               if candidates[a] != candidates[b] and key(a) > key(b) and cut[b] >= cut[a]]
    rng.shuffle(options)
    options.sort(key=lambda p: -gap(*p))  # stable: the shuffle orders equal gaps
    pairs, seen = [], set()
    for a, b in options:
        if len(pairs) < k and (candidates[a], candidates[b]) not in seen:
            seen.add((candidates[a], candidates[b]))
            pairs.append((a, b))
    return pairs


def main(args):
    common.refuse(args.num_candidates < 2 and "--num_candidates must be at least 2 (pairs need two candidates)",
                  args.pairs_per_state < 1 and "--pairs_per_state must be at least 1",
                  not 0 < args.data_fraction <= 1 and "--data_fraction must be in (0, 1]",
                  args.state_batch < 1 and "--state_batch must be at least 1",
                  args.max_batch_tokens < 1 and "--max_batch_tokens must be positive",
                  args.temperature <= 0 and "--temperature must be positive (greedy candidates are all the same)",
                  not 0 < args.top_p <= 1 and "--top_p must be in (0, 1]",
                  args.agent_backend not in ("hf", "openai", "vllm") and "--agent_backend: choose hf, openai or vllm",
                  args.agent_backend == "openai" and not args.agent_url and "--agent_backend openai needs --agent_url",
                  args.cross_kind not in ("turn", "decision") and f"--cross_kind {args.cross_kind}: choose turn or decision",
                  any("=" not in kv for kv in args.credit_critics.split(",") if kv)
                  and f"--credit_critics {args.credit_critics}: expected NAME=DIR,NAME=DIR")
    critic_dirs, groups = critic_members({"sweet": args.critic, **dict(kv.split("=", 1) for kv in args.credit_critics.split(",") if kv)})
    critic_settings, ref_name = load_critics(critic_dirs)
    policy_name = args.policy or ref_name
    if args.agent_backend == "vllm":
        models.pin_gpu()  # before anything touches CUDA: this rank's engine and models on its own GPU
    shard, num_shards = common.parse_shard(args.shard)
    models.seed_everything(args.seed + shard)
    rng = random.Random(args.seed + shard)

    graded = colbench.load_graded(args.trajectories)
    random.Random(args.seed).shuffle(graded)
    graded = graded[: max(1, round(args.data_fraction * len(graded)))]
    states = [(t, i, inp) for t in graded for i, (inp, _) in enumerate(colbench.agent_turns(t))][shard::num_shards]

    out_path = common.sharded_path(args.output, shard, num_shards)
    common.check_writable(out_path)
    common.save_run_settings(f"{out_path}.run_settings.json", args)
    key = lambda r: (r["task_id"], r["sample"], r["turn"])
    state_log = common.ResumableWriter(Path(f"{out_path}.states.jsonl"), key)
    # keep only pairs of fully labelled states (a crash between the two writes leaves no half state)
    if out_path.exists():
        kept = [r for _, r in common.read_jsonl(out_path, tolerate_partial_last_line=True) if key(r) in state_log.done]
        common.write_jsonl(out_path, kept)
    pairs_out = common.ResumableWriter(out_path, key=lambda r: (*key(r), r["chosen"], r["rejected"]))
    todo = [s for s in states if (s[0]["task_id"], s[0].get("sample", 0), s[1]) not in state_log.done]
    print(f"{len(states)} states in this shard, {len(states) - len(todo)} done, {len(todo)} to label", file=sys.stderr)
    if todo:
        label(args, todo, critic_dirs, groups, critic_settings, ref_name, policy_name, rng, pairs_out, state_log)
    pairs_out.close()
    state_log.close()
    credit.report(out_path, list(groups), credit.ensemble_members(groups))
    print(f"wrote {out_path}")


def critic_members(specs):
    """{name: "DIR" or "DIR+DIR+..."} -> ({member: DIR}, {name: [its members]}). Several directories (one critic
    trained with other seeds) make an ensemble, whose advantage is the mean of its members' (Scorer.advantages):
    a critic trained on ~200 pairs ranks candidates differently from seed to seed, and the mean ranks them more
    steadily (docs/frontend.md, "Critics from other seeds"). Members are named NAME/1, NAME/2, ..."""
    members, groups = {}, {}
    for name, spec in specs.items():
        dirs = [d for d in str(spec).split("+") if d]
        common.refuse(not dirs and f"critic {name}: no directory given")
        groups[name] = [name] if len(dirs) == 1 else [f"{name}/{k}" for k in range(1, len(dirs) + 1)]
        members.update(zip(groups[name], dirs))
    return members, groups


def load_critics(critic_dirs):
    """({name: run_settings of each train_critic.py output}, pi_ref): every critic must start from one pi_ref
    (paths compared resolved, a relative one from the directory its critic was trained in)."""
    for name, d in critic_dirs.items():
        common.refuse(not (Path(d) / "run_settings.json").exists()
                      and f"critic {name}={d}: no run_settings.json (expected a train_critic.py output directory)")
    settings = {name: json.loads((Path(d) / "run_settings.json").read_text()) for name, d in critic_dirs.items()}
    first = next(iter(settings))
    ref_name = models.named_model(settings[first]["model"], settings[first])
    common.refuse(*[models.named_model(s["model"], s) != ref_name and f"critic {name} starts from {s['model']}, critic {first} "
                    f"from {settings[first]['model']}: one pi_ref for all" for name, s in settings.items()])
    return settings, ref_name


class Scorer:
    """Scores candidate turns of a state: every critic's advantage (each with pi_ref on the same input), every
    ensemble's (the mean of its members'; critic_members) and, on procedural tasks, every candidate's true class."""

    def __init__(self, tok, critics, critic_settings, ref, max_len, max_turns, max_batch_tokens=None, bottom=None, groups=None):
        self.tok, self.critics, self.settings, self.ref = tok, critics, critic_settings, ref
        self.groups = groups or {name: [name] for name in critics}
        self.max_len, self.max_batch_tokens, self.bottom = max_len, max_batch_tokens, bottom
        self.classes = credit.TrueClasses(max_turns)  # the diagnostics' ground truth (credit.py), not the algorithm's

    @classmethod
    def load(cls, critic_dirs, critic_settings, ref_name, device, max_len, max_turns, max_batch_tokens, keep_frozen=True,
             dtype="auto", groups=None):
        """The critics and pi_ref from disk. Critics trained with --train_layers N from pi_ref share its frozen
        layers: with keep_frozen those run once per state for all of them (common.FrozenBottom). dtype: as
        --score_dtype. The scorer's .plain_ref is pi_ref as loaded (what a sampler may reuse)."""
        common.refuse(models.dtype_problem("--score_dtype", dtype))
        top = {s.get("train_layers", 0) for s in critic_settings.values()}
        top = top.pop() if len(top) == 1 and keep_frozen else 0
        weights = torch.float32 if dtype == "float32" else None  # None: bf16 on a GPU, fp32 on a CPU
        load = lambda name: models.load_model(name, device, dtype=weights, train_layers=top).eval()
        critics, plain_ref = {name: load(d) for name, d in critic_dirs.items()}, load(ref_name)
        ref = plain_ref
        if dtype == "bfloat16" and plain_ref.dtype == torch.float32:  # a CPU: bf16 matmuls on fp32 weights
            critics, ref = {name: models.bf16_matmuls(m) for name, m in critics.items()}, models.bf16_matmuls(plain_ref)
        scorer = cls(models.load_tokenizer(ref_name), critics, critic_settings, ref, max_len, max_turns, max_batch_tokens,
                     common.FrozenBottom.common_to([ref, *critics.values()], top), groups)
        scorer.plain_ref = plain_ref
        return scorer

    @torch.no_grad()
    def advantages(self, task, prompt, candidates, decisions=False):
        """{critic name: [advantage of each candidate]}, train_critic's A(o_t, a_t, c); an ensemble's is the mean of
        its members' (also in the dict). decisions: also, second, the same form over each candidate's first line
        alone (common.first_line_tokens; from the same pass), equal for candidates whose first lines are the same tokens."""
        out, dec, ref_scores = {}, {}, {}
        for name, critic in self.critics.items():
            s = self.settings[name]
            # c reaches the critic and pi_ref, as the critic was trained with it
            prefix = training_info(task, s.get("no_training_info", False), s.get("training_info", "reference"))
            prompt_ids, cand_ids = common.encode_shared(self.tok, prefix, prompt, candidates, self.max_len)
            heads = [common.first_line_tokens(self.tok, c, len(ids)) for c, ids in zip(candidates, cand_ids)] if decisions else None
            scores = common.shared_prompt_logprobs(critic, prompt_ids, cand_ids, max_tokens=self.max_batch_tokens,
                                                   bottom=self.bottom, heads=heads)
            if prefix not in ref_scores:  # pi_ref once per distinct input
                ref_scores[prefix] = common.shared_prompt_logprobs(self.ref, prompt_ids, cand_ids, bottom=self.bottom,
                                                                   max_tokens=self.max_batch_tokens, heads=heads)
            ref = ref_scores[prefix]
            out[name] = turn_advantage(scores[0], ref[0], scores[1], s["beta"]).tolist()
            if decisions:
                a = turn_advantage(scores[2], ref[2], torch.tensor(heads, dtype=scores[2].dtype), s["beta"]).tolist()
                same = {}  # one first line, one decision: the mean over its candidates (batches differ in the last bits)
                for i, ids in enumerate(cand_ids):
                    same.setdefault(tuple(ids[:heads[i]]), []).append(a[i])
                dec[name] = [sum(v) / len(v) for v in (same[tuple(ids[:h])] for ids, h in zip(cand_ids, heads))]
        for name, members in self.groups.items():
            if len(members) > 1:
                for d in (out, dec) if decisions else (out,):
                    d[name] = [sum(a) / len(a) for a in zip(*(d[m] for m in members))]
        if self.bottom is not None:
            self.bottom.kept.clear()  # this state's frozen-layer states are not needed again
        return (out, dec) if decisions else out


def label(args, todo, critic_dirs, groups, critic_settings, ref_name, policy_name, rng, pairs_out, state_log):
    """Sample, score and pair the candidates of every state in todo; one states.jsonl row per state."""
    device = models.local_device()  # cuda:LOCAL_RANK under torchrun
    sampler = None
    if args.agent_backend == "vllm":  # vLLM first, with its share of the GPU; the critics and pi_ref fit after it
        sampler = models.make_sampler("vllm", policy_name, args.temperature, args.top_p, args.max_new_tokens, args.seed,
                                        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_len)
    scorer = Scorer.load(critic_dirs, critic_settings, ref_name, device, args.max_len, args.max_turns,
                         args.max_batch_tokens, args.keep_frozen, args.score_dtype, groups)
    sampler = sampler or models.make_sampler(args.agent_backend, policy_name, args.temperature, args.top_p,
                                               args.max_new_tokens, args.seed, args.agent_url, args.batch_size,
                                               loaded=scorer.plain_ref if models.named_model(policy_name) == ref_name else None,
                                               max_batch_tokens=args.max_batch_tokens, decode_dtype=args.decode_dtype)

    bar = common.tqdm_if(None, True, "states", total=len(todo))
    for first in range(0, len(todo), args.state_batch):  # candidates of state_batch states in one sampling batch
        chunk = todo[first:first + args.state_batch]
        keys = [f"{traj['task_id']}/{traj.get('sample', 0)}/{turn}/{k}" for traj, turn, _ in chunk
                for k in range(args.num_candidates)]
        sampled = sampler.generate([prompt for _, _, prompt in chunk for _ in range(args.num_candidates)], keys)
        for j, state in enumerate(chunk):  # the policy never sees c
            mine = slice(j * args.num_candidates, (j + 1) * args.num_candidates)
            label_state(state, sampled[mine], scorer, args.pairs_per_state, rng, pairs_out, state_log,
                        args.cross_kind == "decision", sampler.cut[mine])
            bar.update(1)
    bar.close()
    scorer.classes.close()


def label_state(state, candidates, scorer, pairs_per_state, rng, pairs_out, state_log, decide=False, cut=None):
    """Score one state's candidates with every critic, write its pairs and its states.jsonl row. decide: rank
    by the first line's advantage first (--cross_kind decision); cut: the candidates the token cap cut off."""
    traj, turn, prompt = state
    advantages, decisions = scorer.advantages(traj["task"], prompt, candidates, decisions=True) if decide else \
        (scorer.advantages(traj["task"], prompt, candidates), None)
    advantage = advantages["sweet"]
    base = {"task_id": traj["task_id"], "sample": traj.get("sample", 0), "turn": turn}
    for a, b in make_pairs(candidates, advantage, pairs_per_state, rng, decisions and decisions["sweet"], cut):
        pairs_out.write({"prompt": prompt, "chosen": candidates[a], "rejected": candidates[b],
                         "chosen_advantage": advantage[a], "rejected_advantage": advantage[b], **base})
    row = {**base, "candidates": candidates, "advantages": advantage, **({"decisions": decisions["sweet"]} if decide else {}),
           **({"cut": list(cut)} if cut is not None else {})}
    classes = scorer.classes(traj, turn, candidates)
    if classes is not None:  # procedural task: every candidate's true class
        row["classes"] = classes
        row["told_all"] = colbench.knows_every_fact(traj["task"], credit.state_dialogue(traj, turn))
        row["advantages_by_critic"] = advantages
        if decide:
            row["decisions_by_critic"] = decisions
    state_log.write(row)


if __name__ == "__main__":
    common.run(main, Args, __doc__)
