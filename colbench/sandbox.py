"""The sandboxed unit-test grader (backend programming): every untrusted program, model answers and
ground truths alike, runs in a child process, never in a stage's own process.

    from colbench import sandbox
    sandbox.grade_code(task, answer)           # {'reward', 'success', 'passed', 'total', 'verdicts', ...}
    sandbox.run_calls(code, [(name, "f(1)")])  # per-call verdicts and decoded results

See docs/grader.md for what is contained and how it is tested
(tests/test_sandbox.py: 43 hostile payloads).
"""
from __future__ import annotations

import builtins
import collections
import datetime
import decimal
import fractions
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


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
    #    Values are encoded by exact type (a subclass is not its base), so whatever the code defines,
    #    only data of these types reaches the comparison; namedtuples count as tuples (tuple's __eq__).
    import collections, datetime, decimal, fractions, signal
    typ, esc, frepr, irepr, hexb, dict_items, isfinite = (type, json.encoder.encode_basestring_ascii,
        float.__repr__, int.__repr__, bytes.hex, dict.items, math.isfinite)
    NoneT, Bool, Int, Float, Str, Complex, Bytes = type(None), bool, int, float, str, complex, bytes
    List, Tuple, Set, FSet, Dict = list, tuple, set, frozenset, dict
    seqs = {List: "list", Tuple: "tuple", Set: "set", FSet: "frozenset"}
    write, fd, BaseExc, exit_now = os.write, job["fd"], BaseException, os._exit
    maps = {Dict: "dict", collections.Counter: "Counter", collections.OrderedDict: "OrderedDict",
            collections.defaultdict: "defaultdict"}
    DT, Date, Time, TD, TZ = (datetime.datetime, datetime.date, datetime.time, datetime.timedelta,
                              datetime.timezone)
    Dec, Frac, dec_str, tuple_iter = decimal.Decimal, fractions.Fraction, decimal.Decimal.__str__, tuple.__iter__
    mro_of, dict_of, issub = type.__dict__["__mro__"].__get__, type.__dict__["__dict__"].__get__, issubclass
    known_types = {v: k for k, v in vars(builtins).items() if typ(v) is type}
    known_types.update({c: "datetime." + c.__name__ for c in (DT, Date, Time, TD, TZ)})
    known_types.update({Dec: "decimal.Decimal", Frac: "fractions.Fraction"})
    known_types.update({c: "collections." + n for c, n in maps.items() if c is not Dict})
    np = None
    if "numpy" in job["code"]:  # read-only numpy, imported before the code so its types are the real ones
        sys.path.insert(0, job["site"])
        try:
            import numpy as np
            np_scalars = {t for t in set(np.sctypeDict.values()) if np.dtype(t).kind in "biufcU"}
            nd, nd_tolist, nd_dtype, nd_shape = (np.ndarray, np.ndarray.tolist, np.ndarray.dtype.__get__,
                                                 np.ndarray.shape.__get__)
            np_item, dtype_str = np.generic.item, np.dtype.str.__get__
        except ImportError:
            np = None
    class Unencodable(Exception):
        pass
    class CallTimeout(BaseException):
        pass
    def plain_tuple(t):  # a tuple subclass that keeps tuple's own comparison
        for c in mro_of(t):
            if c is Tuple:
                return True
            if "__eq__" in dict_of(c) or "__ne__" in dict_of(c):
                return False
        return False
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
        if t in maps:
            pairs = ["[" + enc(k, budget, depth + 1) + "," + enc(v, budget, depth + 1) + "]" for k, v in dict_items(x)]
            return '["' + maps[t] + '",[' + ",".join(pairs) + "]]"
        if issub(t, Tuple) and plain_tuple(t):  # a namedtuple
            return '["tuple",[' + ",".join([enc(v, budget, depth + 1) for v in tuple_iter(x)]) + "]]"
        if t is TD:
            return '["timedelta",[' + ",".join([irepr(x.days), irepr(x.seconds), irepr(x.microseconds)]) + "]]"
        if t is Date:
            return '["date",[' + ",".join([irepr(x.year), irepr(x.month), irepr(x.day)]) + "]]"
        if t is DT or t is Time:
            tz = x.tzinfo
            if tz is not None and typ(tz) is not TZ:
                raise Unencodable("unsupported tzinfo")
            off = "null" if tz is None else enc(tz.utcoffset(None), budget, depth + 1)
            hms = [irepr(x.hour), irepr(x.minute), irepr(x.second), irepr(x.microsecond), irepr(x.fold)]
            ymd = [irepr(x.year), irepr(x.month), irepr(x.day)] if t is DT else []
            return '["' + ("datetime" if t is DT else "time") + '",[' + ",".join(ymd + hms + [off]) + "]]"
        if t is TZ:
            return '["timezone",' + enc(x.utcoffset(None), budget, depth + 1) + "]"
        if t is Dec:
            return '["Decimal",' + esc(dec_str(x)) + "]"
        if t is Frac:
            parts = enc(x.numerator, budget, depth + 1) + "," + enc(x.denominator, budget, depth + 1)
            return '["Fraction",[' + parts + "]]"
        if np is not None and t in np_scalars:
            return '["np",[' + esc(dtype_str(np.dtype(t))) + "," + enc(np_item(x), budget, depth + 1) + "]]"
        if np is not None and t is nd and nd_dtype(x).kind in "biufcU":
            return ('["ndarray",[' + esc(dtype_str(nd_dtype(x))) + ",[" + ",".join(irepr(n) for n in nd_shape(x)) + "],"
                    + enc(nd_tolist(x), budget, depth + 1) + "]]")
        if t is type:
            return '["type",' + esc(known_types[x]) + "]" if x in known_types else '["opaque",null]'
        raise Unencodable("unsupported type")
    me, getpid, in_calls, forked = os.getpid(), os.getpid, [False], [False]
    os.register_at_fork(after_in_parent=lambda: in_calls[0] and forked.__setitem__(0, True))  # the code can't undo it
    def emit(name, status, payload):
        if getpid() != me:  # a copy the code forked: it never reports (the runner below says it forked)
            exit_now(0)
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
    if job["call_timeout"]:
        def on_alarm(*_):
            raise CallTimeout
        signal.signal(signal.SIGALRM, on_alarm)
    g = {"__name__": "__colbench__", "__builtins__": builtins}
    loc = {} if job["released"] else g  # released quirk: code exec'd in a function's locals
    err = None
    try:
        exec(job["code"], g, loc)
    except BaseExc as e:
        err = reason(e)
    in_calls[0] = True
    for name, fn, args, kwargs, c in calls:
        if err is not None:
            emit(name, "exception", err)
            continue
        try:
            try:
                if job["call_timeout"]:
                    signal.setitimer(signal.ITIMER_REAL, job["call_timeout"])
                if fn is None:
                    value = eval(c, g, loc)
                else:
                    f = loc[fn] if fn in loc else g[fn] if fn in g else getattr(builtins, fn)
                    value = f(*args, **kwargs)
            finally:
                if job["call_timeout"]:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        except CallTimeout:
            emit(name, "timeout", '"no result in the released 1 s"')
            continue
        except BaseExc as e:
            emit(name, "exception", reason(e))
            continue
        try:
            payload = enc(value, [100000, 1 << 20], 0)
        except BaseExc as e:
            emit(name, "unencodable", esc(str(e)[:100]) if typ(e) is Unencodable else reason(e))
            continue
        emit(name, "ok", payload)
    if forked[0]:  # a call forked: its copies never report (emit), so say it here, whatever the timing
        emit("__forked__", "ok", "null")
    emit("__done__", "ok", "null")
    exit_now(0)
main()
"""

_SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "TZ": "UTC", "LANG": "C.UTF-8", "HOME": "/tmp"}
SANDBOX_PYTHON = os.path.realpath(sys.executable)  # the real interpreter: the child needs no venv (-S)
SANDBOX_MAX_PROCS = 64
SANDBOX_TMP_BYTES = 64 << 20
SANDBOX_SITE = ""  # numpy's read-only folder as the sandboxed code sees it (set with the sandbox)
RELEASED_CALL_TIMEOUT = 1.0  # released: each answer test under a 1 s alarm; the ground truth has none
_sandbox = None  # (command prefix, drops uid, private tmp) decided once per process


def _numpy_dirs():
    """numpy's package folders (numpy, numpy.libs) in this environment, offered read-only to the code."""
    import importlib.util
    spec = importlib.util.find_spec("numpy")
    if spec is None or not spec.submodule_search_locations:
        return []
    pkg = Path(list(spec.submodule_search_locations)[0])
    return [d for d in (pkg, pkg.with_name("numpy.libs")) if d.is_dir()]


def _site_dir(bwrap):
    """The folder put on the sandboxed code's sys.path: numpy alone, never the rest of this environment."""
    global SANDBOX_SITE
    if bwrap:
        SANDBOX_SITE = "/opt/sweetrl-site"
        return [a for d in _numpy_dirs() for a in ("--ro-bind", str(d), f"{SANDBOX_SITE}/{d.name}")]
    SANDBOX_SITE = tempfile.mkdtemp(prefix="sweetrl-site-")
    os.chmod(SANDBOX_SITE, 0o755)  # readable by the dropped uid
    for d in _numpy_dirs():
        os.symlink(d, Path(SANDBOX_SITE, d.name))
    return []


def _bwrap_args():
    """A filesystem with only /usr, the interpreter's prefix and numpy (read-only), and a private /tmp."""
    a = ["--perms", "1777", "--size", str(SANDBOX_TMP_BYTES), "--tmpfs", "/tmp", "--ro-bind", "/usr", "/usr",
         "--proc", "/proc", "--dev", "/dev", *_site_dir(bwrap=True)]
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
        _site_dir(bwrap=False)
        return ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--net"], True, False
    else:
        missing = "bubblewrap is missing (apt install bubblewrap) and this is not root"
    print(f"sweetrl sandbox: WARNING {missing}: untrusted code runs only in a separate process with resource "
          "limits, under your uid, with your files and network reachable", file=sys.stderr)
    _site_dir(bwrap=False)
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
            _remove_stale_cgroups(root)
            base.mkdir()
            import atexit
            atexit.register(lambda: [_remove_cgroup(p) for p in [*base.iterdir(), base] if p.is_dir()])
        d = base / str(next(_cgroup_count))
        d.mkdir()
        (d / "pids.max").write_text(str(SANDBOX_MAX_PROCS))
        return d
    except OSError:
        return None


def _remove_stale_cgroups(root):
    """Remove the empty pids cgroups of stages that died without cleaning up (a SIGKILL skips atexit): a
    sweetrl-PID folder whose PID is gone. Only empty ones: rmdir refuses a group that still holds a process, and
    nothing here kills (the PID may be another PID namespace's)."""
    for base in root.glob("sweetrl-*"):
        try:
            os.kill(int(base.name.split("-", 1)[1]), 0)
            continue  # its stage is alive
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue  # not ours to judge
        try:
            for d in [*base.iterdir(), base]:
                if d.is_dir():
                    d.rmdir()
        except OSError:
            pass  # not empty, or another stage removed it first


def _remove_cgroup(d):
    """Kill what is left in pids cgroup d, again until none is left (a fork bomb can fork between the read and the
    kill), then remove it (killed processes may take a moment to leave)."""
    for _ in range(100):
        try:
            pids = (d / "cgroup.procs").read_text().split()
        except OSError:
            return  # already gone
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        if not pids:
            try:
                d.rmdir()
                return
            except OSError:
                pass
        time.sleep(0.02)


def _end_uid(uid, wait_s=5.0):
    """Kill every live process of sandbox uid `uid` and wait until none is left. Killing the namespace's first
    process makes the kernel kill the rest, but not at once (a fork bomb's 64 take a moment to exit, and a process
    leaves its cgroup before it finishes exiting): without this wait a dying process can still hold the uid (and
    count against RLIMIT_NPROC) when the pool hands it to the next program. A zombie runs nothing and is skipped."""
    deadline = time.monotonic() + wait_s
    while True:
        live = []
        for p in filter(str.isdigit, os.listdir("/proc")):
            try:
                status = open(f"/proc/{p}/status").read()
                if int(status.split("Uid:")[1].split()[0]) == uid and status.split("State:")[1].split()[0] != "Z":
                    live.append(int(p))
            except (OSError, IndexError, ValueError):
                continue  # not a process, or it left while we read it
        if not live or time.monotonic() > deadline:
            return
        for pid in live:
            try:
                os.kill(pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def run_calls(code, calls, timeout=10.0, released=False, mem_mb=1024, trusted=False):
    """Run `code`, then each (name, call expression), in a sandbox. Returns {name: (status, value)}:
    ("ok", plain Python data) or (exception | unencodable | timeout | crash | infrastructure, reason).
    Never raises: an infrastructure failure is a status, so a run always goes on. With `released`,
    each call of a non-`trusted` program (an answer, not a ground truth) has the released 1 s."""
    global _sandbox, _uids
    calls = list(calls)
    try:
        if _sandbox is None:
            _sandbox = _choose_sandbox()
        if _uids.pid != os.getpid():  # a forked worker process gets uids of its own
            _uids = _UidPool()
        with _uids as uid:
            return _run_sandboxed(code, calls, timeout, released, mem_mb, uid, trusted)
    except Exception as e:  # e.g. no pipes or processes left: the run goes on, the test is unjudged
        return {name: ("infrastructure", f"{type(e).__name__}: {e}") for name, _ in calls}


def _run_sandboxed(code, calls, timeout, released, mem_mb, uid, trusted):
    prefix, drops_uid, private_tmp = _sandbox
    r_fd, w_fd = os.pipe()
    job = json.dumps({"code": code, "calls": calls, "released": released, "fd": w_fd, "site": SANDBOX_SITE,
                      "call_timeout": RELEASED_CALL_TIMEOUT if released and not trusted else 0,
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
            _remove_cgroup(cgroup)  # and anything that left the process group
        if drops_uid:
            _end_uid(uid)  # the uid goes back to the pool with none of its processes alive
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
            if name == "__forked__" or name in results:  # the code forked during its calls (or two writers)
                forked = True
            elif status == "ok":
                results[name] = ("ok", _decode(payload))
            elif status in ("exception", "unencodable", "timeout"):
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


# The types the runner encodes by name, and the mappings it tags, as this process builds them.
_KNOWN_TYPES = {k: v for k, v in vars(builtins).items() if type(v) is type}
_KNOWN_TYPES.update({f"datetime.{c.__name__}": c for c in (datetime.datetime, datetime.date, datetime.time,
                                                            datetime.timedelta, datetime.timezone)})
_KNOWN_TYPES.update({"decimal.Decimal": decimal.Decimal, "fractions.Fraction": fractions.Fraction})
_KNOWN_TYPES.update({f"collections.{n}": getattr(collections, n) for n in ("Counter", "OrderedDict", "defaultdict")})
_MAPS = {"dict": dict, "Counter": lambda items: collections.Counter(dict(items)),
         "OrderedDict": collections.OrderedDict, "defaultdict": lambda items: collections.defaultdict(None, items)}


def _decode(node):
    """The runner's tagged encoding -> the same value built here from trusted types, so that `==`
    here compares what the released grader's `==` compares."""
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
    if tag in _MAPS:
        try:
            return _MAPS[tag]([(_decode(k), _decode(x)) for k, x in v])
        except TypeError:
            return _Opaque()
    if tag == "timedelta":
        return datetime.timedelta(days=v[0], seconds=v[1], microseconds=v[2])
    if tag == "timezone":
        return datetime.timezone(_decode(v))
    if tag == "date":
        return datetime.date(*v)
    if tag in ("datetime", "time"):
        *fields, fold, off = v
        tz = None if off is None else datetime.timezone(_decode(off))
        return (datetime.datetime if tag == "datetime" else datetime.time)(*fields, tzinfo=tz, fold=fold)
    if tag == "Decimal":
        return decimal.Decimal(v)
    if tag == "Fraction":
        return fractions.Fraction(_decode(v[0]), _decode(v[1]))
    if tag in ("np", "ndarray"):
        import numpy as np
        if tag == "np":
            return np.dtype(v[0]).type(_decode(v[1]))
        return np.array(_decode(v[2]), dtype=np.dtype(v[0])).reshape(v[1])
    if tag == "type":
        return _KNOWN_TYPES.get(v, _Opaque())
    return _Opaque()


# The released grader's substring blacklist, exactly (it scores any answer containing one 0); used
# only with --released_semantics, to compare with published numbers.
RELEASED_BLACKLIST = ("import os", "from os", "import sys", "from sys", "sudo", "transformers", "exit(", "quit(",
                      "argparse")


def strip_fences(code, released=False):
    """Drop markdown code fences around the answer. Released: its exact rule (the text after the first
    ```python up to the next ```, then the same for a bare ```)."""
    if released:
        if "```python" in code:
            code = code.split("```python")[1].split("```")[0]
        if "```" in code:
            code = code.split("```")[1].split("```")[0]
        return code
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
        gt_results = run_calls(task["ground_truth"], calls, timeout, released, trusted=True)
    answer = answer or ""
    if released and any(b in answer for b in RELEASED_BLACKLIST):  # released: checked before the fences go
        ans_results = {n: ("exception", "blacklisted") for n, _ in calls}
    else:
        ans_results = run_calls(strip_fences(answer, released), calls, timeout, released)
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


