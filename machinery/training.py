"""What only the two trainers share: their settings (TrainerArgs), the loop (train), pi_ref's log-probs computed once
(reference_logprobs), FSDP2 over any world size with lock-step micro-batches, the memory estimate that decides
activation checkpointing, the optimizer, checkpoints and --resume, the step log. Nothing else imports it."""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import common
from machinery import models


@dataclass(kw_only=True)
class TrainerArgs:
    """The settings both trainers have (each stage's Args adds its own)."""
    model: str = "embedded"
    """the starting model, and pi_ref (HF path or id)"""
    task_type: str = "code"
    """code | html"""
    beta: float = 0.1
    """scale of the log-ratio (critic: of the advantage; DPO: of the implicit reward)"""
    lr: float = 2e-7
    """AdamW learning rate (released: 2e-7 for 8B)"""
    batch_size: int = 8
    """examples (pairs, or dialogues for sft) per optimizer step, over all ranks"""
    train_layers: int = 0
    """train only the top N decoder layers (+ final norm; 0 = all): a cheaper backward on CPU"""
    dtype: str = "auto"
    """compute dtype: auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float32. The weights the optimizer
    updates stay fp32 (mixed precision): a bf16 weight would round a 2e-7 step away"""
    save_dtype: str = "float32"
    """float32 (the trained weights as they are) | bfloat16 (half the size, for serving: a weight whose
    whole update is below half a bf16 step rounds back to its starting value)"""
    grad_ckpt: bool = False
    """activation checkpointing always; without it, on a GPU only where the longest example would not fit"""
    save_minutes: float = 30.0
    """save the training state (model + optimizer) to OUTPUT_DIR/resume when this many minutes have passed since
    the last save (0: after every step; inf: never), written in the background while training goes on"""
    resume: bool = False
    """continue from OUTPUT_DIR/resume (the same data-order settings) instead of starting over"""
    schedule: str = "released"
    """released: the release's optimizer (warm-up over 3% of the steps, cosine to 0.1x, AdamW betas 0.9 / 0.95) |
    constant: a constant rate, AdamW's default betas (the embedded CPU run)"""
    seed: int = 0
    """data order (critic: and its held-out split)"""


def setup(args):
    """A trainer's start: (rank, world, device, tokenizer), the output directory checked before any work."""
    import torch
    common.check_writable(args.output_dir.rstrip("/") + "/")
    rank, world, device = init_distributed()
    torch.manual_seed(args.seed)
    return rank, world, device, models.load_tokenizer(args.model)


def trainer_model(args, longest, world, device):
    """(the model to update, whether it recomputes activations), for examples of at most `longest` tokens."""
    ckpt = recompute(args.model, args.grad_ckpt, longest, world, device, args.train_layers)
    dtype = models.compute_dtype(args.dtype, device)
    return training_model(args.model, world, device, dtype, ckpt, args.train_layers), ckpt


def reference_logprobs(model, items, fn, forwards, args, device, content):
    """pi_ref = the starting weights: fn(model, item) for every item, once, before any update. Kept in
    OUTPUT_DIR/ref_logprobs by content (content(item): its token ids) and the model's name and dtype, so a resumed or
    rerun stage reads them instead of computing them again."""
    import torch.distributed as dist
    scored_by = [models.resolve_model(args.model), str(models.compute_dtype(args.dtype, device))]
    cache = (Path(args.output_dir) / "ref_logprobs", lambda x: content_key(scored_by, content(x)))
    return precompute(model, items, fn, dist.get_rank(), dist.get_world_size(), forwards, cache=cache)


def train(model, args, items, loss_fn, forwards, keys, extra=None, after_step=None):
    """The trainers' loop over global batches of `items`: loss_fn(model, item) -> (loss, metrics) for each item of
    this rank's share, one item a micro-batch; the step's gradient is the mean over the global batch (backward
    scales it); clip, step, log. keys: the metrics summed over items and ranks; --steps if the stage has it, else
    --epochs passes. extra(step) -> more log fields; after_step(step, steps). Returns (the log, the number of steps)."""
    import torch.distributed as dist
    rank = dist.get_rank()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.train()
    opt = make_optimizer(model, args.lr, args.schedule)
    order = {k: getattr(args, k) for k in ("batch_size", "seed", "epochs", "steps") if hasattr(args, k)}  # --resume
    start = load_training_state(model, opt, out / "resume", order) if args.resume else 0
    log = TrainingLog(out, start, rank)
    saves = Checkpointer(out / "resume", args.save_minutes, order, rank)
    batches = batch_order(len(items), args.batch_size, args.epochs, args.seed, getattr(args, "steps", 0))
    for step, (epoch, batch) in enumerate(batches, 1):
        if step <= start:
            continue  # done before the restart
        t0, sums = time.time(), dict.fromkeys(["n", *keys], 0)
        for item in micro_batches(model, [items[i] for i in batch], forwards):  # this rank's share
            loss, metrics = loss_fn(model, item)  # one item a micro-batch: memory holds one item's graph
            backward(model, loss, len(batch))
            for k, v in {"n": 1, **metrics}.items():
                sums[k] += v
        lr = args.lr * lr_factor(step, len(batches), args.schedule)
        grad_norm = optimizer_step(model, opt, lr)
        sums, seconds = step_sums(sums, grad_norm), time.time() - t0
        log.write(step_line(step, epoch, sums, seconds, {"lr": lr, **(extra(step) if extra else {})}))
        saves.after_step(model, opt, step, step == len(batches))
        if after_step:
            after_step(step, len(batches))
    saves.finish()
    return log, len(batches)


def init_distributed():
    """Returns (rank, world_size, device) in a process group: nccl on GPU, gloo on CPU. torchrun's world, or a
    world of one for plain `python` (an in-memory store): one process trains with FSDP2 over a one-rank mesh,
    the same code that runs on eight."""
    import datetime
    import torch
    import torch.distributed as dist
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(hours=1)  # the other ranks wait in a barrier while rank 0 writes an 8B checkpoint
        if "MASTER_ADDR" in os.environ:  # torchrun
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def recompute(name, forced, tokens, world, device, train_layers=0):
    """Whether a training stage checkpoints activations (recomputes them in backward): when --grad_ckpt forces
    it, or on a GPU where the longest micro-batch (`tokens`, padding included) would not fit without it
    (needs_recompute); never on a CPU, where memory is not what bounds a run. Says which on rank 0."""
    import torch
    from transformers import AutoConfig
    if forced or device.type != "cuda":
        return forced
    config = AutoConfig.from_pretrained(models.resolve_model(name))
    memory = torch.cuda.get_device_properties(device).total_memory
    need, fits = needs_recompute(config, tokens, world, memory, train_layers)
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"activation checkpointing {'on' if need else 'off'}: the longest micro-batch ({tokens} tokens) "
              f"{'needs more than' if need else 'fits in'} {fits / 2**30:.1f} GiB without it", flush=True)
    return need


def needs_recompute(config, tokens, world, memory, train_layers=0):
    """(need, room): whether the activations that backward keeps for a micro-batch of `tokens` tokens exceed the
    room that 80% of a GPU's `memory` bytes leaves beside what training holds (training_memory)."""
    held, activations = training_memory(config, tokens, world, train_layers)
    room = 0.8 * memory - held  # the rest: the allocator's slack, backward's transient buffers
    return activations > room, room


def training_memory(config, tokens, world, train_layers=0):
    """(held, activations) in bytes on one rank, estimated from a Llama-style config. held: this rank's share of
    the fp32 weights, their gradients and AdamW's two moments (16 bytes a trained parameter, 4 a frozen one,
    over `world` ranks; the embeddings train unless train_layers freezes the bottom); the bf16 copies FSDP2
    gathers (the root's embeddings and head, kept for the whole step, the layer at work, the next one prefetched
    and the last one, kept after its forward); and the unsharded fp32 gradient of the largest unit (a layer, or
    the embeddings), held until its reduce-scatter (backward). activations: what backward keeps for a micro-batch
    of `tokens` tokens in bf16: 16 * hidden + 8 * intermediate bytes a token in each trained decoder layer (norm
    inputs, q/k/v, the attention output under flash-attention, the MLP's gate, up and product), and bf16 logits
    of every token beside an fp32 chunk of 1,024 rows (token_logprobs)."""
    h, inter, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    layer = h * head_dim * (2 * heads + 2 * kv) + 3 * h * inter  # q, o; k, v; gate, up, down
    embed = vocab * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    trained = min(train_layers or layers, layers)
    state = (16 * trained * layer + 4 * (layers - trained) * layer + (4 if train_layers else 16) * embed) / world
    gathered = 2 * (embed + 3 * layer) + 4 * (layer if train_layers else max(layer, embed))
    activations = tokens * (trained * (16 * h + 8 * inter) + 2 * vocab) + 1024 * vocab * 8
    return state + gathered, activations


def training_model(name, world, device, dtype=None, grad_ckpt=False, train_layers=0):
    """The model a training stage updates: fp32 master weights, compute in dtype (shard_model). It is built
    empty (meta device) on every rank and sharded; rank 0 alone reads the weights, on the CPU, and each rank
    receives only its shards: no rank ever holds the whole model on its accelerator (a world of one: the same)."""
    import torch
    import torch.distributed as dist
    model = models.load_model(name, device, grad_ckpt, torch.float32, train_layers, empty=True)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    buffers = dict(model.named_buffers())  # computed, not read (rotary frequencies): to_empty would lose them
    full = {}
    if dist.get_rank() == 0:
        full = models.load_model(name, torch.device("cpu"), dtype=torch.float32).state_dict()
    model = shard_model(model, world, device, dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        for n, b in buffers.items():
            model.get_buffer(n).copy_(b)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def shard_model(model, world, device, dtype=None):
    """FSDP2: fully_shard each decoder layer, then the root, over a mesh of every rank (one rank: the same code);
    it counts its forwards (count_forwards). dtype (compute) below the fp32 weights: mixed precision, AdamW
    updates fp32 master weights (a 2e-7 step on a bf16 weight of 1e-2 rounds away); FSDP2 casts gathered
    parameters to dtype and reduces gradients in fp32."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mixed = dtype is not None and dtype != next(model.parameters()).dtype
    mesh = init_device_mesh(device.type, (world,))
    if mesh.get_rank() == 0:
        backend = torch.distributed.get_backend(mesh.get_group())
        compute = str(dtype if mixed else next(model.parameters()).dtype).removeprefix("torch.")
        print(f"FSDP2 over {world} rank{'s' * (world > 1)} ({backend}), compute in {compute}", flush=True)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    layers = model.model.layers
    for i, layer in enumerate(layers):  # the last layer stays gathered after its forward: its backward comes next
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    return count_forwards(fully_shard(model, mesh=mesh, mp_policy=mp))


def all_reduce(x, op="sum"):
    """Sum (or max) a python number across ranks; identity for one process."""
    import torch
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    t = torch.tensor(float(x), device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.item()


def barrier():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def step_sums(sums, grad_norm):
    """A step's metrics, summed over its examples on this rank (tensors, kept on the device while the step ran, or
    numbers), summed over the ranks in one all_reduce, with the gradient norm: one host sync for the step. Every rank
    passes the same keys (a rank with no example passes zeros)."""
    import torch
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2: a DTensor
    keys = sorted(sums)
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=grad_norm.device).reshape(())
                     for v in [*(sums[k] for k in keys), grad_norm / world]])  # the norm is already global
    if world > 1:
        dist.all_reduce(t)
    return dict(zip([*keys, "grad_norm"], t.tolist()))


def save_checkpoint(model, tokenizer, out_dir, rank, settings=None, dtype=None):
    """Gather the full state dict to rank 0 and save a plain HF checkpoint (loads in transformers and
    vLLM), in the weights' own dtype (fp32 master weights) or in dtype (--save_dtype bfloat16, for
    serving). Written to a temp dir first and moved in file by file, config.json last: a directory
    with a config.json holds a complete checkpoint, whenever the run was killed. Says so on rank 0."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = model.state_dict()
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    if rank == 0:
        out_dir = Path(out_dir)
        tmp = out_dir / ".checkpoint.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=state)
        if dtype is not None:  # save_pretrained writes the model's own dtype into config.json
            config = json.loads((tmp / "config.json").read_text())
            config["dtype"] = str(dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_pretrained(tmp)
        if settings is not None:
            common.save_run_settings(tmp / "run_settings.json", settings)
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
            os.replace(f, out_dir / f.name)
        tmp.rmdir()
        shutil.rmtree(out_dir / "resume", ignore_errors=True)  # the run is complete
        print(f"saved {out_dir}", flush=True)
    barrier()


def save_training_state(model, opt, resume_dir, step, order, rank, background=False):
    """Model and optimizer state (torch.distributed.checkpoint: each rank writes its own shards) to
    a temp dir, renamed into place when complete: a kill at any moment leaves the previous state.
    background: the state is copied to host memory now and written by a thread while training goes
    on; returns the function that waits for the writes and renames them in (else it is called here)."""
    import warnings
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    tmp, old = resume_dir.with_name("resume.tmp"), resume_dir.with_name("resume.old")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        if background:  # the writer thread's collectives go in a gloo group of their own, beside training's
            group = getattr(save_training_state, "group", None)
            if group is None and dist.is_available() and dist.is_initialized():
                group = save_training_state.group = dist.new_group(backend="gloo")
            written = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(tmp), process_group=group,
                                     no_dist=group is None)
        else:
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))

    def complete():
        if background:
            written.result()
        barrier()
        if rank == 0:
            (tmp / "meta.json").write_text(json.dumps({"step": step, **order}))
            if resume_dir.exists():  # complete (only ever renamed into place); an older resume.old left by a
                shutil.rmtree(old, ignore_errors=True)  # kill after the last rename would block this rename
                os.replace(resume_dir, old)
            os.replace(tmp, resume_dir)
            shutil.rmtree(old, ignore_errors=True)
        barrier()
    if background:
        return complete
    complete()


class Checkpointer:
    """The training state under RESUME_DIR, saved once `minutes` have passed since the last save (0: after every
    step, inf: never), in the background (save_training_state): the next save, or the end, completes it. So one
    state is on disk, and one more while it is written. Every rank saves when any rank's clock says so."""

    def __init__(self, resume_dir, minutes, order, rank):
        self.dir, self.seconds, self.order, self.rank = resume_dir, minutes * 60, order, rank
        self.last, self.pending = time.time(), None

    def after_step(self, model, opt, step, last_step):
        if self.seconds == float("inf"):  # never (the same on every rank): no collective either
            return
        due = not last_step and time.time() - self.last >= self.seconds
        if all_reduce(float(due), "max") > 0:
            self.finish()
            self.pending = save_training_state(model, opt, self.dir, step, self.order, self.rank, background=True)
            self.last = time.time()

    def finish(self):
        """Complete the save under way, if any."""
        if self.pending:
            self.pending()
            self.pending = None


def load_training_state(model, opt, resume_dir, order):
    """Restore what save_training_state wrote; returns the step to continue after (0: nothing saved)."""
    import warnings
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    old = resume_dir.with_name("resume.old")
    if not (resume_dir / "meta.json").exists():
        resume_dir = old  # killed between the two renames
    if not (resume_dir / "meta.json").exists():
        return 0
    meta = json.loads((resume_dir / "meta.json").read_text())
    clash = [f"--{k} {meta.get(k)} (this run: {v})" for k, v in order.items() if meta.get(k) != v]
    if clash:
        raise SystemExit(f"--resume: {resume_dir} was written with {', '.join(clash)}; the data order would differ. "
                         f"Rerun with the same settings, or drop --resume to start over.")
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(resume_dir))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return meta["step"]


def count_forwards(model):
    """Count the model's forward calls (model.forwards), for the lock-step padding (pad_forwards). Called once
    by shard_model."""
    model.forwards = 0

    def hook(module, args):
        module.forwards += 1
    model.register_forward_pre_hook(hook, prepend=True)
    return model


def dummy_forwards(model, n):
    """n zero-weight forwards (0 * logits, a graph for backward), padding a rank's forwards under FSDP."""
    import torch
    device = next(model.parameters()).device
    out = torch.zeros((), device=device)
    for _ in range(int(n)):
        logits = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), logits_to_keep=1).logits
        out = out + 0.0 * logits.sum()
    return out


def seq_forwards(*seqs):
    """The forwards turn_logprobs runs on the tokenize_turns sequences of one or more trajectories: one,
    or none when no sequence scores an agent token."""
    return int(any(any(t >= 0 for t in turn_of[1:]) for part in seqs for _, turn_of in part))


def shared_forwards(conts):
    """The forwards shared_prompt_logprobs (max_tokens None) runs: the prompt, then one per length group."""
    return 1 + len(common.length_groups([len(c) for c in conts]))


def padded_tokens(*seqs):
    """The tokens turn_logprobs forwards for the tokenize_turns sequences of one or more trajectories:
    rows times the longest, padding included."""
    rows = [len(ids) for part in seqs for ids, _ in part]
    return len(rows) * max(rows, default=0)


def lockstep_plan(batch, world, forwards):
    """FSDP's collectives need every rank to run as many forwards and backwards. A global batch (example indices)
    goes to the ranks in turn, one example per micro-batch; every rank computes the same plan from data all ranks
    hold, so lock-step needs no message. Returns (each rank's indices, the forwards each micro-batch runs on
    every rank: the most that any rank's example runs, forwards(i), and at least one)."""
    shares = [batch[r::world] for r in range(world)]
    return shares, [max(max(1, forwards(s[j])) if j < len(s) else 1 for s in shares)
                    for j in range(max(map(len, shares)))]


def pad_forwards(model, planned, world):
    """Zero-weight forwards until this rank has run `planned` in this lock-step region (under torchrun); their sum,
    or None. More than planned means the stage's forward count is wrong, which would hang the other ranks: raised."""
    if model.forwards > planned:
        raise RuntimeError(f"{model.forwards} forwards where the lock-step plan had {planned}: the stage's forward "
                           f"count (seq_forwards / shared_forwards) does not match what its loss runs")
    return dummy_forwards(model, planned - model.forwards) if world > 1 and planned > model.forwards else None


def micro_batches(model, examples, forwards):
    """This rank's share of a global batch (`examples`, the same list on every rank), one example a micro-batch,
    for the caller's forward and backward(model, loss). FSDP's collectives wait for every rank, so every rank runs
    as many micro-batches, and in each as many forwards (forwards(example): what the caller's loss runs), as the
    others: the plan comes from data every rank holds (lockstep_plan, no message), backward pads a micro-batch's
    forwards to it, and a rank with fewer examples runs zero-weight micro-batches after its last."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    shares, plan = lockstep_plan(list(range(len(examples))), world, lambda i: forwards(examples[i]))
    for j, planned in enumerate(plan):
        model.planned = planned  # backward pads to it
        if j < len(shares[rank]):
            yield examples[shares[rank][j]]
        else:
            backward(model, None)


def backward(model, loss, batch_size=1):
    """One micro-batch's backward (of micro_batches), in lock-step with the other ranks: its forwards are padded to
    the plan's with zero-weight ones (loss None or without a gradient: only those). The one place a loss is scaled:
    / the global batch size (the step's gradient: the batch's mean) * the world size (FSDP averages over ranks).
    Every micro-batch's gradients are reduce-scattered as its backward runs and added to this rank's shard: a
    rank never holds more than one layer's unsharded gradient, whatever the number of micro-batches (FSDP2's
    default; syncing only at the last micro-batch would keep the whole unsharded fp32 gradient until then)."""
    import torch.distributed as dist
    world = dist.get_world_size()
    if loss is None or not loss.requires_grad:  # nothing to learn here, but a backward must exist
        loss = dummy_forwards(model, 1)
    pad = pad_forwards(model, model.planned, world)
    ((loss if pad is None else loss + pad) * (world / batch_size)).backward()
    model.forwards = 0


def precompute(model, items, fn, rank, world, forwards, desc="reference log-probs", cache=None):
    """fn(model, item) -> json-able result for every item, without grad; items are split across ranks
    in lock-step rounds (forwards(item): the forwards fn runs) and the results gathered on every rank (used
    to compute pi_ref log-probs once, before training, and for held-out metrics). cache = (directory,
    key(item) -> str): results already in the directory's files (any rank's, any earlier run's) are read, not
    computed again, and each new one is appended to this rank's file as soon as it is made, so a resumed or
    rerun stage skips what a killed one finished (key: a digest of the item's content and the model's)."""
    import math
    import torch
    import torch.distributed as dist
    results, todo, keys, writer = {}, list(range(len(items))), None, None
    if cache:
        folder, key = Path(cache[0]), cache[1]
        keys = [key(x) for x in items]
        rows = (r for f in sorted(folder.glob("rank*.jsonl")) for _, r in common.read_jsonl(f, True))
        known = {r["key"]: r["value"] for r in rows}
        barrier()  # every rank has read before any rank appends
        results = {i: known[k] for i, k in enumerate(keys) if k in known}
        todo = list({keys[i]: i for i in reversed(todo) if i not in results}.values())[::-1]  # one item a key
        writer = common.ResumableWriter(folder / f"rank{rank}.jsonl", key=lambda r: r["key"])
        if rank == 0:
            print(f"{desc}: {len(results)} of {len(items)} read from {folder}, {len(todo)} to compute", flush=True)
    mine = {}
    with torch.no_grad():
        for j in common.tqdm_if(range(math.ceil(len(todo) / world)), rank == 0, desc):
            part = todo[j * world:(j + 1) * world]
            if rank < len(part):
                i = part[rank]
                mine[i] = fn(model, items[i])
                if writer:
                    writer.write({"key": keys[i], "value": mine[i]})
            pad_forwards(model, max(forwards(items[i]) for i in part), world)
            model.forwards = 0
    if writer:
        writer.close()
    if dist.is_initialized():
        # FSDP2 leaves the root's parameters unsharded after a forward with no backward: reshard, or
        # an optimizer built next would hold the temporary unsharded tensors and never update them
        for m in model.modules():
            if hasattr(m, "reshard"):
                m.reshard()
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        mine = {k: v for part in gathered for k, v in part.items()}
    results.update(mine)
    if keys:  # an item whose content another item has: the same result
        by_key = {keys[i]: v for i, v in results.items()}
        return [by_key[k] for k in keys]
    return [results[i] for i in range(len(items))]


def content_key(*parts):
    """A digest of json-able parts (an item's token ids, the model that scores it): precompute's cache key."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


SCHEDULES = ("released", "constant")  # --schedule of the training stages


def make_optimizer(model, lr, schedule):
    """AdamW over the trainable weights, no weight decay: betas (0.9, 0.95) as released (--schedule released),
    or AdamW's default (0.9, 0.999) with a constant rate (the embedded CPU run)."""
    import torch
    betas = (0.9, 0.95) if schedule == "released" else (0.9, 0.999)
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=betas, weight_decay=0.0)


def lr_factor(step, steps, schedule):
    """Step `step` (1-based) of `steps`'s learning rate, as a share of --lr. released: linear warm-up over the
    first 3% of the steps, then a cosine down to 0.1x at the last step; constant: 1."""
    if schedule != "released":
        return 1.0
    warm = max(1, round(0.03 * steps))
    if step <= warm:
        return step / warm
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


def optimizer_step(model, opt, lr):
    """Clip the gradient norm at 1.0 (released), step at learning rate lr, zero the gradients. Returns the norm."""
    import torch
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)
    return grad_norm


def batch_order(n, batch_size, epochs, seed, steps=0):
    """Global batches of example indices [(epoch, [i, ...])], shuffled each pass; the same on every rank, and the
    same after a restart (it depends only on these arguments). `steps` batches (0: round(epochs x batches per
    pass), at least 1): a fractional epochs ends the last pass early, more steps than a pass repeat the data."""
    per_pass = math.ceil(n / batch_size)
    total = steps or max(1, round(per_pass * epochs))
    rng, out = random.Random(seed), []
    for epoch in range(math.ceil(total / per_pass)):
        order = list(range(n))
        rng.shuffle(order)
        out += [(epoch, order[b:b + batch_size]) for b in range(0, n, batch_size)]
    return out[:total]


def argument_problems(args):
    """refuse()'s checks of the settings both trainers have (TrainerArgs, and --epochs, --output_dir)."""
    out = Path(args.output_dir)
    return [args.task_type not in ("code", "html") and f"--task_type {args.task_type}: choose code or html",
            args.beta <= 0 and "--beta must be positive", args.lr <= 0 and "--lr must be positive",
            args.schedule not in SCHEDULES and f"--schedule {args.schedule}: choose released or constant",
            args.epochs <= 0 and "--epochs must be positive",
            args.batch_size < 1 and "--batch_size must be at least 1",
            args.save_minutes < 0 and "--save_minutes must be >= 0",
            models.dtype_problem("--dtype", args.dtype), args.save_dtype not in ("float32", "bfloat16")
            and f"--save_dtype {args.save_dtype}: choose float32 or bfloat16",
            args.resume and not (out / "resume").exists() and not (out / "resume.old").exists()
            and f"--resume: nothing to resume in {args.output_dir}/resume"]


class TrainingLog:
    """OUT_DIR/log.jsonl and stdout, one line per step (rank 0 writes). On resume after step `start` the lines of
    later steps (from the killed run) are dropped."""

    def __init__(self, out_dir, start, rank):
        self.path, self.rank = Path(out_dir) / "log.jsonl", rank
        self.history = [r for _, r in common.read_jsonl(self.path, True)][:start] if start else []
        if rank == 0:
            common.write_jsonl(self.path, self.history)
            if start:
                print(f"resuming after step {start}", flush=True)

    def write(self, line):
        """line: {'step', 'epoch', metric: value, ...}; metrics summed over ranks by the caller."""
        self.history.append(line)
        if self.rank == 0:
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in line.items()), flush=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")


def step_line(step, epoch, sums, seconds, extra=None):
    """One log line from step_sums: metrics summed over the batch's examples (and ranks) -> means; tokens -> tokens/s;
    on a GPU, this rank's peak memory since the start (gpu_peak_gib)."""
    n = max(sums.pop("n", 0), 1)
    tokens = sums.pop("tokens", 0)
    grad_norm = sums.pop("grad_norm")
    import torch
    gpu = {"gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30} if torch.cuda.is_initialized() else {}
    return {"step": step, "epoch": epoch, **{k: v / n for k, v in sums.items()}, "grad_norm": grad_norm,
            "tokens_per_s": tokens / seconds, "seconds": seconds, **gpu, **(extra or {})}
