"""Shared toolbox for every stage, top to bottom: JSONL I/O and run settings, the command line,
the OpenAI-compatible HTTP client for the simulated human, the per-turn log-prob helpers, and the
distributed and training helpers. The models (the embedded default, loading, the policy's
samplers) are in models.py; ColBench's rules (tasks, prompts, the scripted human, turn classes) are in colbench.py; the grader's
sandbox in sandbox.py; rendering and image similarity in render.py.

Nothing here is stage logic; a helper lives here only when two or more stages need it.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


CACHE_DIR = Path(os.environ.get("SWEETRL_CACHE", Path.home() / ".cache" / "sweetrl"))


# ----------------------------------------------------------------------------------------------
# JSONL I/O: every stage reads and writes one JSON object per line. Errors name file and line.
# ----------------------------------------------------------------------------------------------
class ServerError(ConnectionError):
    """A server (simulated human, agent) that cannot be reached or answers wrongly: one line saying
    what was tried and what to do, never a traceback."""


class RequestRefused(ServerError):
    """A 4xx answer: the request itself is wrong (unknown model, prompt too long, ...). Never retried."""
    def __init__(self, message, status):
        super().__init__(message)
        self.status = status


class DataError(ValueError):
    """Bad input data; the message names the file and line to fix."""


def read_jsonl(path, tolerate_partial_last_line=False):
    """Return a list of (line_number, object). A malformed line raises DataError naming it.
    With tolerate_partial_last_line, an unterminated last line (a run killed mid-write) is
    ignored instead, so a resumed run rewrites it."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file not found")
    rows, lines = [], path.read_text(encoding="utf-8").split("\n")
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
    write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


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
    dropped with a warning. Each row is flushed when written, so finished work survives a crash.
    `elsewhere`: the keys that other files already hold (shards of another rank count, done_elsewhere)."""

    def __init__(self, path, key, retry=None, elsewhere=()):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.key, self.done, self.elsewhere = key, set(), set(elsewhere)
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

    def finished(self, k):
        return k in self.done or k in self.elsewhere

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
    settings = dict(vars(args), git_commit=commit, argv=sys.argv, cwd=os.getcwd())  # cwd: where relative paths start
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
    """Shard i of n writes PATH.shard-i-of-n; merge_shards joins the shards (of any n) into PATH."""
    return Path(path) if num_shards == 1 else Path(f"{path}.shard-{shard_index}-of-{num_shards}")


def shard_files(path, suffix=""):
    """PATH's shard files (PATH.shard-i-of-n + suffix, any n), in order of n, then i."""
    pattern = re.compile(re.escape(Path(path).name) + r"\.shard-(\d+)-of-(\d+)" + re.escape(suffix))
    found = [(m, f) for f in Path(path).parent.glob(f"{Path(path).name}.shard-*") if (m := pattern.fullmatch(f.name))]
    return [f for m, f in sorted(found, key=lambda x: (int(x[0][2]), int(x[0][1])))]


def row_key(r):
    """What a row of a sharded output is about: a dialogue (task_id, sample), a state (+ turn) or a pair (+ texts)."""
    return tuple(r.get(k) for k in ("task_id", "sample", "turn", "chosen", "rejected"))


def done_elsewhere(path, mine, key, suffix="", retry=None):
    """Resume by content, not by rank count: key(row) of the rows finished in PATH + suffix itself and in its shard
    files of any rank count, other than `mine` (this rank's file). A rerun with another NPROC skips them."""
    files = [f for f in [Path(f"{path}{suffix}"), *shard_files(path, suffix)] if f.exists() and f != Path(mine)]
    return {key(r) for f in files for _, r in read_jsonl(f, True) if not (retry and retry(r))}


def merge_shards(path, suffix=""):
    """PATH + suffix := its rows and those of its shard files (any rank count), one row per row_key (a key is done
    in one file only, but for a dialogue redone after finish=error: the finished row wins)."""
    rows = {}
    target = Path(f"{path}{suffix}")
    for f in ([target] if target.exists() else []) + shard_files(path, suffix):
        for _, r in read_jsonl(f, True):
            k = row_key(r)
            if k not in rows or rows[k].get("finish") == "error" or r.get("finish") != "error":
                rows[k] = r
    write_jsonl(target, rows.values())


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
    """Under torchrun, leave the process group once every rank is done, then exit at once: the FSDP
    modules still hold the group, and freeing gloo's threads during interpreter shutdown can abort a
    finished rank ("terminate called without an active exception", SIGABRT: rare, seen once in CI),
    which fails the whole torchrun. Every output is written and flushed by now (JsonlWriter flushes
    each row; checkpoints end in a barrier)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# ----------------------------------------------------------------------------------------------
# OpenAI-compatible chat client (the simulated human; also an `openai` agent backend)
# ----------------------------------------------------------------------------------------------
class ChatClient:
    """POST /v1/chat/completions with a timeout, retries with backoff (connection errors, cut-off
    replies, timeouts, 5xx) for `retry_time` s, and a thread pool. After a request failed for good,
    later ones get 5 s each until one succeeds: a dead server ends the other dialogues quickly."""

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
                if 400 <= r.status_code < 500:
                    self.down = False
                    raise RequestRefused(f"{method} {self.base_url}{path}: HTTP {r.status_code}: {server_message(r)}",
                                         r.status_code)
                if r.status_code < 400:
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
        except RequestRefused as e:
            raise ServerError(f"tried GET {url}: HTTP {e.status}. This is not the root of an OpenAI-compatible "
                              f"server: give http://HOST:PORT or http://HOST:PORT/v1, nothing after it.") from None
        except ServerError as e:
            raise ServerError(f"tried GET {url}: no answer ({e}). Check the URL (http://HOST:PORT, the server "
                              f"adds /v1) or start the embedded human with `python simulator.py --port PORT`.") from None
        except (requests.RequestException, ValueError, KeyError, IndexError, TypeError) as e:
            raise ServerError(f"tried GET {url}: {type(e).__name__}: {e}. Give the URL of an OpenAI-compatible "
                              f"server as http://HOST:PORT (e.g. `python simulator.py` or `vllm serve`).") from None

    def chat(self, messages, temperature=0.0, max_tokens=256, **extra):
        body = {"model": self.model, "messages": messages, "temperature": temperature,
                "max_tokens": max_tokens, **extra}
        return self._request("POST", "/chat/completions", json=body)["choices"][0]["message"]["content"] or ""

    def complete(self, prompt, temperature=0.0, max_tokens=256, choice=False, **extra):
        """Raw-prompt completion (/v1/completions): the prompt string is used exactly as given. Returns
        its text, or with choice=True the server's whole choice (text, finish_reason: "length" when
        max_tokens cut it off)."""
        body = {"model": self.model, "prompt": prompt, "temperature": temperature, "max_tokens": max_tokens, **extra}
        first = self._request("POST", "/completions", json=body)["choices"][0]
        return first if choice else first["text"] or ""

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


def server_message(r):
    """The error message of a server's reply (OpenAI format: {"error": {"message": ...}}), else its text."""
    try:
        err = r.json().get("error", {})
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = None
    return " ".join(str(msg or r.text or r.reason).split())[:300]


# ----------------------------------------------------------------------------------------------
# Per-turn log-prob helpers (shared by train_critic.py, label_turns.py, train_dpo.py)
#
# Agent turns are stored as exact (input, output) strings, maybe from another model's chat template:
# we tokenise them as stored, never re-render. When turn t+1's input starts with turn t's input +
# output (ordinary chat templates), the trajectory is ONE sequence [prefix][input_1][output_1][rest
# of input_2][output_2]... and one forward scores every turn. A template that trims content (Llama-3.1's)
# shows an output with white space at its ends trimmed in later inputs: that turn is scored as shown there,
# and the trajectory stays one sequence. Only a template that rewrites history otherwise starts a new
# sequence (counted and reported by extra_rows). The end-of-turn token after an output counts
# as part of that agent turn (training teaches the model to stop); the system prompt, user turns and the
# training-time prefix c never count.
# ----------------------------------------------------------------------------------------------
def tokenize_turns(tokenizer, turns, prefix="", max_len=None):
    """Token sequences for one trajectory. Returns a list of (ids, turn_of) where turn_of[i] is the
    agent-turn index that token i belongs to, or -1. With max_len, a longer sequence keeps the prefix
    (the critic's training-time information c) and the last tokens of the dialogue, max_len in all
    (a turn cut off entirely then has no tokens)."""
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"] if s else []
    eos, eos_id, pre = tokenizer.eos_token, tokenizer.eos_token_id, enc(prefix)
    if not turns:
        return []
    seqs, text, ids, turn_of = [], "", list(pre), [-1] * len(pre)
    for t, (inp, out) in enumerate(turns):
        if not inp.startswith(text):  # a template that rewrites history: a new sequence
            seqs.append((ids, turn_of))
            text, ids, turn_of = "", list(pre), [-1] * len(pre)
        rest = inp[len(text):]
        rest = rest[len(eos):] if text and rest.startswith(eos) else rest  # already counted with the last output
        later = turns[t + 1][0] if t + 1 < len(turns) else None
        shown = next((o for o in (out, out.strip(), out.rstrip(), out.lstrip())
                      if later is not None and later.startswith(inp + o + eos)), out)  # as the next input shows it
        r, o = enc(rest), enc(shown) + [eos_id]
        ids, turn_of = ids + r + o, turn_of + [-1] * len(r) + [t] * len(o)
        text = inp + shown + eos
    seqs.append((ids, turn_of))
    if max_len:  # keep c (the prefix) whole and the last tokens of the dialogue: the dialogue is cut, never c
        keep = max(max_len - len(pre), 1)
        seqs = [(i[:len(pre)] + i[len(pre):][-keep:], o[:len(pre)] + o[len(pre):][-keep:]) if len(i) > max_len else (i, o)
                for i, o in seqs]
    return seqs


def extra_rows(all_seqs, rank=0):
    """(trajectories of more than one sequence, sequences beyond one a trajectory) among tokenize_turns results,
    said on rank 0 when there are any: what a chat template that rewrites history costs (rows padded alike)."""
    many = [len(seqs) - 1 for seqs in all_seqs if len(seqs) > 1]
    if many and rank == 0:
        print(f"{len(many)} of {len(all_seqs)} trajectories take {sum(many)} more rows than one each: their chat "
              f"template rewrites earlier turns in later inputs beyond trimming white space", flush=True)
    return len(many), sum(many)


def sequence_logprobs(model, seqs, chunk=1024):
    """Log-probs of the agent tokens of several sequences [(ids, turn_of)] in one forward pass: the rows
    right-padded and the padding masked (no mask when none is padded). Logits are computed only at the
    positions that predict an agent token of some row, and the log-softmax in chunks of rows; every index
    is built on the host, so the pass never waits for the device.
    Returns [(logp [n_agent_tokens], turn index of each [n_agent_tokens])], one per sequence."""
    import torch
    device = next(model.parameters()).device
    width = max(len(ids) for ids, _ in seqs)
    scored = [[p for p in range(1, len(ids)) if turn_of[p] >= 0] for ids, turn_of in seqs]  # the first never is
    keep = sorted({p - 1 for row in scored for p in row})  # the positions some row needs logits at
    if not keep:
        return [(torch.zeros(0, device=device), torch.zeros(0, dtype=torch.long, device=device))] * len(seqs)
    at = {p: j for j, p in enumerate(keep)}
    tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)
    ids_t = tensor([ids + [0] * (width - len(ids)) for ids, _ in seqs])
    mask = None if all(len(ids) == width for ids, _ in seqs) else tensor([[1] * len(ids) + [0] * (width - len(ids))
                                                                          for ids, _ in seqs])
    logits = model(input_ids=ids_t, attention_mask=mask, logits_to_keep=tensor(keep)).logits  # [rows, keep, vocab]
    return [(token_logprobs(logits[b, tensor([at[p - 1] for p in row])], tensor([ids[p] for p in row]), chunk),
             tensor([turn_of[p] for p in row])) for b, ((ids, turn_of), row) in enumerate(zip(seqs, scored))]


def token_logprobs(logits, targets, chunk=1024):
    """log softmax(logits)[target] of each row ([n, vocab], [n] -> [n]), in fp32, chunk rows at a time."""
    import torch
    out = []
    for rows, t in zip(logits.split(chunk), targets.split(chunk)):
        rows = rows.float()  # one fp32 copy of a chunk at a time
        out.append(rows.gather(1, t[:, None]).squeeze(1) - torch.logsumexp(rows, -1))
    return torch.cat(out)


def turn_logprobs(model, seqs, num_turns):
    """Per-turn (sum, count) of agent-token log-probs over a trajectory's sequences, in one forward.
    sum: [num_turns] float (differentiable), count: [num_turns] tokens per turn. mean = sum / count."""
    return trajectories_logprobs(model, [(seqs, num_turns)])[0]


def trajectories_logprobs(model, trajs):
    """turn_logprobs of each trajectory in trajs [(seqs, num_turns)], every sequence of every one in a single
    forward: a critic's or multi-turn DPO's pair (chosen and rejected) costs one forward, so FSDP gathers and
    reduces each layer once per pair."""
    import torch
    device = next(model.parameters()).device
    flat = [s for seqs, _ in trajs for s in seqs]
    results = iter(sequence_logprobs(model, flat) if flat else [])
    out = []
    for seqs, num_turns in trajs:
        total, count = torch.zeros(num_turns, device=device), torch.zeros(num_turns, device=device)
        for _ in seqs:
            logp, turn = next(results)
            total, count = total.index_add(0, turn, logp), count.index_add(0, turn, torch.ones_like(logp))
        out.append((total, count))
    return out


# ------------------------------- FAST PATH (same numbers) -------------------------------------
# turn_logprobs above is the path to read. The one faster path below scores N continuations of one
# prompt (label_turns' candidates, turn-level DPO's chosen and rejected) with the prompt run once;
# tests/test_training.py checks it equal to turn_logprobs, values and gradients.
# ----------------------------------------------------------------------------------------------
def with_cache(model, cache):
    """{name: cache} for a forward: transformers 5.2x calls the KV cache `cache` (`past_key_values` warns
    there and goes in 5.40); 5.19, the one vLLM pins, knows only `past_key_values`."""
    import inspect
    if type(model) not in _CACHE_NAME:
        _CACHE_NAME[type(model)] = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {_CACHE_NAME[type(model)]: cache}


_CACHE_NAME = {}


def cache_of(out):
    """The KV cache a forward returned, under either name (with_cache)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def cache_on(kv, rows=1):
    """A fresh DynamicCache holding [(keys, values) per layer] of a one-row pass, as rows rows (expanded,
    not copied): a pass on it appends to the new cache, never to those tensors."""
    from transformers import DynamicCache
    cache = DynamicCache()
    for layer, (k, v) in enumerate(kv):
        cache.update(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1), layer)
    return cache


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


LOGITS_BUDGET = 2**28  # shared_prompt_logprobs with max_tokens: logits held at once (1 GiB in fp32)


def shared_prompt_logprobs(model, prompt_ids, conts, chunk=1024, max_tokens=None):
    """Summed log-prob and token count of each continuation of one prompt: the prompt runs once, then
    the continuations as right-padded batches of similar length (length_groups) on its KV cache;
    gradients flow through the cache into the prompt's pass. Equal to turn_logprobs of prompt +
    continuation one by one (tests check 1e-4, gradients too). Returns two [N] tensors. Needs a KV
    cache (not with activation checkpointing). max_tokens bounds memory (label_turns --max_batch_tokens;
    None: one batch per length group): each row holds its own copy of the prompt's KV cache, so a batch
    has at most max_tokens // (prompt + longest continuation) rows, and its logits at most LOGITS_BUDGET."""
    import torch
    from transformers import DynamicCache
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([prompt_ids], device=device), **with_cache(model, DynamicCache()), use_cache=True, logits_to_keep=1)
    first = torch.log_softmax(out.logits[0, -1].float(), -1)[[c[0] for c in conts]]  # the prompt's last position predicts token 0
    prompt_kv = [(layer.keys, layer.values) for layer in cache_of(out).layers]
    del out
    sums = list(first)
    for group in length_groups([len(c) for c in conts]):
        L = max(len(conts[i]) for i in group)
        rows = len(group) if max_tokens is None else max(1, min(max_tokens // (len(prompt_ids) + L),  # KV cache
                                                               LOGITS_BUDGET // (L * model.config.vocab_size)))
        for part in (group[k:k + rows] for k in range(0, len(group), rows)):
            n = len(part)
            cache = cache_on(prompt_kv, rows=n)
            ids = torch.zeros((n, L), dtype=torch.long, device=device)
            mask = torch.zeros((n, len(prompt_ids) + L), dtype=torch.long, device=device)
            mask[:, :len(prompt_ids)] = 1
            for row, i in enumerate(part):
                ids[row, :len(conts[i])] = torch.tensor(conts[i], device=device)
                mask[row, len(prompt_ids):len(prompt_ids) + len(conts[i])] = 1
            # position j of the batch predicts continuation token j+1 (the last position predicts nothing)
            logits = model(input_ids=ids, **with_cache(model, cache), attention_mask=mask,
                           logits_to_keep=torch.arange(L - 1, device=device) if L > 1 else 1).logits  # [n, L-1, vocab]
            del cache
            for row, i in enumerate(part):
                m = len(conts[i]) - 1
                if m:
                    sums[i] = sums[i] + token_logprobs(logits[row, :m], ids[row, 1:m + 1], chunk).sum()
            del logits
    counts = torch.tensor([float(len(c)) for c in conts], device=device)
    return torch.stack(sums), counts


# ----------------------------------------------------------------------------------------------
# Distributed training with FSDP2: one code path for every world size, plain `python` a world of one.
# ----------------------------------------------------------------------------------------------
def init_distributed():
    """Returns (rank, world_size, device) in a process group: nccl on GPU, gloo on CPU. torchrun's world, or a
    world of one for plain `python` (an in-memory store): one process trains with FSDP2 over a one-rank mesh,
    the same code that runs on eight."""
    import datetime
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
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
    import models
    if forced or device.type != "cuda":
        return forced
    config = AutoConfig.from_pretrained(models.resolve_model(name))
    need, fits = needs_recompute(config, tokens, world, torch.cuda.get_device_properties(device).total_memory, train_layers)
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
    import models
    model = models.load_model(name, device, grad_ckpt, torch.float32, train_layers, empty=True)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    buffers = dict(model.named_buffers())  # computed, not read (rotary frequencies): to_empty would lose them
    full = models.load_model(name, torch.device("cpu"), dtype=torch.float32).state_dict() if dist.get_rank() == 0 else {}
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
        print(f"FSDP2 over {world} rank{'s' * (world > 1)} ({torch.distributed.get_backend(mesh.get_group())}), compute in "
              f"{str(dtype if mixed else next(model.parameters()).dtype).removeprefix('torch.')}", flush=True)
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
    with a config.json holds a complete checkpoint, whenever the run was killed."""
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
            save_run_settings(tmp / "run_settings.json", settings)
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
            os.replace(f, out_dir / f.name)
        tmp.rmdir()
        shutil.rmtree(out_dir / "resume", ignore_errors=True)  # the run is complete
    barrier()


RESUME_KEYS = ("batch_size", "seed", "epochs")  # what the data order depends on: `order` = {key: value}


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
        out = out + 0.0 * model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), logits_to_keep=1).logits.sum()
    return out


def seq_forwards(*seqs):
    """The forwards trajectories_logprobs runs on the tokenize_turns sequences of one or more trajectories: one,
    or none when no sequence scores an agent token."""
    return int(any(any(t >= 0 for t in turn_of[1:]) for part in seqs for _, turn_of in part))


def shared_forwards(conts):
    """The forwards shared_prompt_logprobs (max_tokens None) runs: the prompt, then one per length group."""
    return 1 + len(length_groups([len(c) for c in conts]))


def padded_tokens(*seqs):
    """The tokens trajectories_logprobs forwards for the tokenize_turns sequences of one or more trajectories:
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


def backward(model, loss, world, planned):
    """One micro-batch's backward, in lock-step with the other ranks: a rank with no example left
    (loss=None) runs one zero-weight forward, and every rank pads its forwards to the plan's (lockstep_plan), so
    that all run the same collectives. FSDP averages gradients over ranks; the loss is already divided by the
    global batch size, so it is multiplied by world here. Every micro-batch's gradients are reduce-scattered
    as its backward runs and added to this rank's shard: a rank never holds more than one layer's unsharded
    gradient, whatever the number of micro-batches (FSDP2's default; syncing only at the last micro-batch
    would keep the whole model's unsharded fp32 gradient on every rank until then)."""
    if loss is None or not loss.requires_grad:  # nothing to learn here, but a backward must exist
        loss = dummy_forwards(model, 1)
    pad = pad_forwards(model, planned, world)
    ((loss if pad is None else loss + pad) * world).backward()
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
        known = {r["key"]: r["value"] for f in sorted(folder.glob("rank*.jsonl")) for _, r in read_jsonl(f, True)}
        barrier()  # every rank has read before any rank appends
        results = {i: known[k] for i, k in enumerate(keys) if k in known}
        todo = list({keys[i]: i for i in reversed(todo) if i not in results}.values())[::-1]  # one item a key
        writer = ResumableWriter(folder / f"rank{rank}.jsonl", key=lambda r: r["key"])
        if rank == 0:
            print(f"{desc}: {len(results)} of {len(items)} read from {folder}, {len(todo)} to compute", flush=True)
    mine = {}
    with torch.no_grad():
        for j in tqdm_if(range(math.ceil(len(todo) / world)), rank == 0, desc):
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


def batch_order(n, batch_size, epochs, seed):
    """Global batches of example indices [(epoch, [i, ...])], shuffled each epoch; the same on every
    rank, and the same after a restart (it depends only on these arguments). A fractional epochs ends
    the last pass early: the first round(epochs x batches per pass) batches (at least 1) of ceil(epochs) passes."""
    rng, out, passes = random.Random(seed), [], math.ceil(epochs)
    for epoch in range(passes):
        order = list(range(n))
        rng.shuffle(order)
        out += [(epoch, order[b:b + batch_size]) for b in range(0, n, batch_size)]
    return out[:max(1, round(len(out) * epochs / passes))]


REPORTERS = ("tensorboard", "wandb")  # --report_to of the training stages


def report_problems(report_to):
    """refuse()'s checks of --report_to: known trackers, installed before any work."""
    import importlib.util
    names = [r for r in report_to.split(",") if r]
    return [f"--report_to {r}: choose from {', '.join(REPORTERS)}" if r not in REPORTERS else
            not importlib.util.find_spec(r) and f"--report_to {r}: `pip install {r}` first" for r in names]


class TrainingLog:
    """OUT_DIR/log.jsonl and stdout, one line per step (rank 0 writes), and the same numbers to each tracker of
    report_to ("tensorboard,wandb": TensorBoard event files in OUT_DIR/tensorboard; a W&B run named by OUT_DIR,
    WANDB_MODE=offline for no server). On resume after step `start` the lines of later steps (from the killed
    run) are dropped, TensorBoard's too, and W&B continues the run it had."""

    def __init__(self, out_dir, start, rank, report_to="", config=None):
        self.path, self.rank = Path(out_dir) / "log.jsonl", rank
        self.history = [r for _, r in read_jsonl(self.path, True)][:start] if start else []
        self.tensorboard = self.wandb = None
        if rank == 0:
            write_jsonl(self.path, self.history)
            if start:
                print(f"resuming after step {start}", flush=True)
            if "tensorboard" in report_to:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
                self.tensorboard = SummaryWriter(Path(out_dir) / "tensorboard", purge_step=start + 1 if start else None)
            if "wandb" in report_to:
                import wandb
                run_id = Path(out_dir) / "wandb_id"
                if not run_id.exists():
                    run_id.write_text(os.urandom(4).hex())
                self.wandb = wandb.init(dir=out_dir, name=Path(out_dir).name, id=run_id.read_text(), resume="allow",
                                        config=config)

    def write(self, line):
        """line: {'step', 'epoch', metric: value, ...}; metrics summed over ranks by the caller."""
        self.history.append(line)
        if self.rank == 0:
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in line.items()), flush=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
            numbers = {k: v for k, v in line.items() if k != "step" and isinstance(v, (int, float))}
            if self.tensorboard:
                for k, v in numbers.items():
                    self.tensorboard.add_scalar(k, v, line["step"])
            if self.wandb:
                self.wandb.log(numbers, step=line["step"])

    def close(self):
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()


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


def tqdm_if(it, show, desc, total=None):
    from tqdm import tqdm
    return tqdm(it, desc=desc, total=total) if show else it


if __name__ == "__main__" and sys.argv[1:2] == ["merge"]:  # run.sh: python common.py merge PATH [SUFFIX]
    merge_shards(*sys.argv[2:4])
