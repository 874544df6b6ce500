"""Shared toolbox for every stage, top to bottom: JSONL I/O, resumable outputs and run settings, the command line
and its errors, the OpenAI-compatible HTTP client for the simulated human, and the per-turn log-probs with their one
fast path. It imports no module of this project; no stage logic lives here, only what two or more stages need.
"""
from __future__ import annotations

import json
import os
import re
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
    for klass in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):  # a stage's Args may extend one
        body = ast.parse(inspect.getsource(klass)).body[0].body
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
            name = f.type if isinstance(f.type, str) else f.type.__name__
            kind = {"int": int, "float": float, "str": str}.get(name, str)
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
    """Under torchrun, leave the process group once every rank is done, then exit at once: freeing gloo's threads
    at interpreter shutdown can abort a finished rank (SIGABRT, seen once in CI) and fail the whole torchrun. Every
    output is written and flushed by now (rows as written; checkpoints end in a barrier)."""
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
            raise ServerError(f"tried GET {url}: no answer ({e}). Check the URL (http://HOST:PORT, the server adds "
                              f"/v1) or start the embedded human with `python simulator.py --port PORT`.") from None
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
        cut = lambda x: x[:len(pre)] + x[len(pre):][-keep:]
        seqs = [(cut(i), cut(o)) if len(i) > max_len else (i, o) for i, o in seqs]
    return seqs


def extra_rows(all_seqs, rank=0):
    """(trajectories of more than one sequence, sequences beyond one a trajectory) among tokenize_turns results,
    said on rank 0 when there are any: what a chat template that rewrites history costs (rows padded alike)."""
    many = [len(seqs) - 1 for seqs in all_seqs if len(seqs) > 1]
    if many and rank == 0:
        print(f"{len(many)} of {len(all_seqs)} trajectories take {sum(many)} more rows than one each: their chat "
              f"template rewrites earlier turns in later inputs beyond trimming white space", flush=True)
    return len(many), sum(many)


def turn_logprobs(model, trajs, chunk=1024):
    """Per-turn log-probs of the agent tokens of one or more trajectories, all in ONE forward pass (a critic's or
    multi-turn DPO's pair, chosen and rejected, costs one forward: FSDP gathers and reduces each layer once).
    trajs: [(seqs, num_turns)], seqs as tokenize_turns makes them [(ids, turn_of)]. Returns [(sum, count)] per
    trajectory: sum [num_turns] of log pi(token) over each turn's tokens (differentiable), count [num_turns]
    tokens; a turn's mean is sum / count."""
    import torch
    device = next(model.parameters()).device
    tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)
    seqs = [s for ss, _ in trajs for s in ss]  # every sequence of every trajectory: one row each, right-padded
    scored = [[p for p in range(1, len(ids)) if turn_of[p] >= 0] for ids, turn_of in seqs]  # agent tokens' places
    keep = sorted({p - 1 for row in scored for p in row})  # logits only where some row predicts an agent token
    logits = None
    if keep:
        width = max(len(ids) for ids, _ in seqs)
        ids_t = tensor([ids + [0] * (width - len(ids)) for ids, _ in seqs])
        padded = any(len(ids) < width for ids, _ in seqs)
        mask = tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in seqs]) if padded else None
        logits = model(input_ids=ids_t, attention_mask=mask, logits_to_keep=tensor(keep)).logits  # [rows, keep, V]
    at = {p: j for j, p in enumerate(keep)}  # every index is built on the host: the pass never waits for the device
    out, b = [], 0
    for ss, num_turns in trajs:
        total, count = torch.zeros(num_turns, device=device), torch.zeros(num_turns, device=device)
        for (ids, turn_of), row in zip(ss, scored[b:b + len(ss)]):
            if row:
                logp = token_logprobs(logits[b, tensor([at[p - 1] for p in row])], tensor([ids[p] for p in row]),
                                      chunk)
                turn = tensor([turn_of[p] for p in row])
                total, count = total.index_add(0, turn, logp), count.index_add(0, turn, torch.ones_like(logp))
            b += 1
        out.append((total, count))
    return out


def token_logprobs(logits, targets, chunk=1024):
    """log softmax(logits)[target] of each row ([n, vocab], [n] -> [n]), in fp32, chunk rows at a time."""
    import torch
    out = []
    for rows, t in zip(logits.split(chunk), targets.split(chunk)):
        rows = rows.float()  # one fp32 copy of a chunk at a time
        out.append(rows.gather(1, t[:, None]).squeeze(1) - torch.logsumexp(rows, -1))
    return torch.cat(out)


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
        names = inspect.signature(model.forward).parameters
        _CACHE_NAME[type(model)] = "cache" if "cache" in names else "past_key_values"
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
    out = model(input_ids=torch.tensor([prompt_ids], device=device), **with_cache(model, DynamicCache()),
                use_cache=True, logits_to_keep=1)
    # the prompt's last position predicts each continuation's token 0
    first = torch.log_softmax(out.logits[0, -1].float(), -1)[[c[0] for c in conts]]
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


def tqdm_if(it, show, desc, total=None):
    from tqdm import tqdm
    return tqdm(it, desc=desc, total=total) if show else it


if __name__ == "__main__" and sys.argv[1:2] == ["merge"]:  # run.sh: python common.py merge PATH [SUFFIX]
    merge_shards(*sys.argv[2:4])
