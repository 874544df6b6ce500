"""The adversarial suite: hostile answers graded in the real sandbox. Each must end within its
timeout plus one second with the right verdict on every test, leave the host's canary files as
they were and leave no process behind; a correct answer wrapped in hostile side effects passes."""
import os
import socket
import subprocess
import sys
import time

import pytest

from colbench import sandbox

TIMEOUT = 2.0
DOUBLE = {"ground_truth": "def f(x):\n    return x * 2\n", "test_cases": {"t1": "f(1)", "t2": "f(2)", "t3": "f(3)"}}
SUM = {"ground_truth": "def g(xs):\n    return sum(xs)\n", "test_cases": {"t1": "g([1, 2])", "t2": "g([1, 2])"}}
ORDER = {"ground_truth": "def h():\n    return list({'apple', 'banana', 'cherry', 'date', 'elder'})\n",
         "test_cases": {"t1": "h()", "t2": "h()"}}
OK = "def f(x):\n    return x * 2\n"  # the correct answer that hostile side effects surround

# name: (task, answer, expected verdict for every test). {canary}, {canary_dir}, {port}, {pid} are
# filled in per run.
PAYLOADS = {
    "python infinite loop": (DOUBLE, "def f(x):\n    while True: pass", "timeout"),
    "C-level infinite loop": (DOUBLE, "def f(x):\n    return sum(range(10**12))", "timeout"),
    "sleep": (DOUBLE, "import time\ndef f(x):\n    time.sleep(100)", "timeout"),
    "swallows timeouts": (DOUBLE, "def f(x):\n    while True:\n        try:\n            while True: pass\n"
                                  "        except BaseException: pass", "timeout"),
    "ignores signals": (DOUBLE, "import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM, signal.SIGXCPU,"
                                " signal.SIGHUP):\n    signal.signal(s, signal.SIG_IGN)\ndef f(x):\n    while True: pass",
                        "timeout"),
    "fork bomb": (DOUBLE, "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", "timeout"),
    "double-forked daemon": (DOUBLE, "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                                     "        time.sleep(1000)\n    os._exit(0)\n" + OK, "pass"),
    "forks and reports twice": (DOUBLE, "import os\ndef f(x):\n    os.fork()\n    return x * 2", "crash"),
    "memory bomb": (DOUBLE, "x = bytearray(8 * 10**9)\n" + OK, "exception"),
    # bytes(n) is calloc'd (fresh zero pages, none touched): the address-space limit, not the time to write 1 GiB
    # on a loaded machine, decides the verdict (bytearray(n) writes its zeros: 7.5 s to the limit on 2 busy cores)
    "growing memory": (DOUBLE, "a = []\nwhile True:\n    a.append(bytes(10**7))\n" + OK, "exception"),
    "runaway recursion": (DOUBLE, "def f(x):\n    return f(x) + 1", "exception"),
    "segfault": (DOUBLE, "import ctypes\ndef f(x):\n    return ctypes.string_at(0)", "crash"),
    "deletes host files": (DOUBLE, "import os, shutil\nshutil.rmtree({canary_dir!r}, ignore_errors=True)\n"
                                   "try: os.remove({canary!r})\nexcept OSError: pass\n" + OK, "pass"),
    "writes host files": (DOUBLE, "for p in ({canary!r}, '/usr/bin/python3', '/etc/passwd'):\n    try: open(p, 'w')"
                                  ".write('pwned')\n    except OSError: pass\n" + OK, "pass"),
    "reads host files": (DOUBLE, "def f(x):\n    try: return open({canary!r}).read()\n    except OSError: return x * 2",
                         "pass"),
    "reads environment": (DOUBLE, "import os\ndef f(x):\n    return -1 if 'SWEETRL_SECRET' in str(os.environ) else x * 2",
                          "pass"),
    "reads other processes": (DOUBLE, "import os\ndef f(x):\n    try: return open('/proc/{pid}/environ').read()\n"
                                      "    except OSError: pass\n    pids = [p for p in os.listdir('/proc') if "
                                      "p.isdigit()]\n    return x * 2 if len(pids) <= 3 else pids", "pass"),
    "socket to the internet": (DOUBLE, "import socket\ndef f(x):\n    try: socket.create_connection(('1.1.1.1', 80), "
                                       "timeout=1)\n    except OSError: return x * 2", "pass"),
    "socket to a local port": (DOUBLE, "import socket\ndef f(x):\n    try: socket.create_connection(('127.0.0.1', "
                                       "{port}), timeout=1)\n    except OSError: return x * 2", "pass"),
    "sys.exit": (DOUBLE, "import sys\nsys.exit(0)\n" + OK, "exception"),
    "os._exit": (DOUBLE, "import os\nos._exit(0)\n" + OK, "crash"),
    "kills its parent": (DOUBLE, "import os\ntry: os.kill(os.getppid(), 9)\nexcept OSError: pass\n" + OK, "pass"),
    "kills every process": (DOUBLE, "import os\ntry: os.kill(-1, 9)\nexcept OSError: pass\n" + OK, "pass"),
    "kills its process group": (DOUBLE, "import os\nos.killpg(0, 9)\n" + OK, "crash"),
    "floods stdout": (DOUBLE, "import sys\ndef f(x):\n    print('y' * 10**7)\n    sys.stderr.write('z' * 10**7)\n"
                              "    return x * 2", "pass"),
    "reads stdin": (DOUBLE, "def f(x):\n    return input()", "exception"),
    "returns a generator": (DOUBLE, "def f(x):\n    return (i for i in range(x))", "unencodable"),
    "returns a lambda": (DOUBLE, "def f(x):\n    return lambda: x * 2", "unencodable"),
    "always-true __eq__": (DOUBLE, "class A:\n    def __eq__(s, o): return True\ndef f(x):\n    return A()",
                           "unencodable"),
    "raising __eq__": (DOUBLE, "class A:\n    def __eq__(s, o): raise RuntimeError\ndef f(x):\n    return A()",
                       "unencodable"),
    "int subclass": (DOUBLE, "class I(int):\n    def __eq__(s, o): return True\ndef f(x):\n    return I(x * 2)",
                     "unencodable"),
    "patches builtins": (DOUBLE, "import builtins\nbuiltins.type = lambda *a: int\nbuiltins.len = lambda *a: 0\n"
                                 "builtins.str = lambda *a: ''\n" + OK, "pass"),
    "patches the runner": (DOUBLE, "import sys, json\nm = sys.modules['__main__']\nfor k in list(vars(m)): "
                                   "setattr(m, k, None)\njson.dumps = json.encoder.encode_basestring_ascii = None\n" + OK,
                           "pass"),
    "closes the result pipe": (DOUBLE, "import os\nfor fd in range(3, 64):\n    try: os.close(fd)\n"
                                       "    except OSError: pass\n" + OK, "crash"),
    "self-referential result": (DOUBLE, "def f(x):\n    a = [x * 2]\n    a.append(a)\n    return a", "unencodable"),
    "huge result": (DOUBLE, "def f(x):\n    return list(range(10**6))", "unencodable"),
    "huge string": (DOUBLE, "def f(x):\n    return 'a' * 10**8", "unencodable"),
    "huge file": (DOUBLE, "def f(x):\n    open('/tmp/big', 'w').write('x' * 10**8)\n    return x * 2", "exception"),
    "fills the disk": (DOUBLE, "def f(x):\n    try:\n        for i in range(1000): open(f'/tmp/f{{i}}', 'w').write('x' * "
                               "(10**6 - 1))\n    except OSError: pass\n    return x * 2", "pass"),
    "leftover threads": (DOUBLE, "import threading\nthreading.Thread(target=lambda: [0 for _ in iter(int, 1)]).start()\n"
                                 + OK, "pass"),
    "mutates its arguments": (SUM, "seen = []\ndef g(xs):\n    seen.append(xs)\n    r = sum(xs)\n"
                                   "    for s in seen: s.append(100)\n    return r", "pass"),
    "random results": (DOUBLE, "import random\ndef f(x):\n    return x * 2 + random.random()", "wrong"),
    "hash-order results": (ORDER, ORDER["ground_truth"].replace("{", "{{").replace("}", "}}"), "pass"),
}


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    d = tmp_path_factory.mktemp("canaries")
    canary = d / "ground_truth.txt"
    canary.write_text("secret ground truth")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    yield {"canary": str(canary), "canary_dir": str(d), "port": listener.getsockname()[1], "pid": os.getpid(),
           "listener": listener}
    listener.close()


def sandbox_processes():
    """Live processes under this grader's sandbox uids (only where the sandbox drops to them). A zombie
    (state Z: exited, its entry not yet collected by the parent it was handed to) runs nothing and is not counted."""
    lo = sandbox._uids.base
    found = []
    for p in os.listdir("/proc"):
        try:
            status = open(f"/proc/{p}/status").read()
            uid = int(status.split("Uid:")[1].split()[0])
            state = status.split("State:")[1].split()[0]
        except (OSError, IndexError, ValueError):
            continue
        if lo <= uid < lo + 64 and state != "Z":
            found.append(p)
    return found


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_hostile_answer_is_contained(name, host, monkeypatch):
    monkeypatch.setenv("SWEETRL_SECRET", "hunter2")
    task, answer, expected = PAYLOADS[name]
    answer = answer.format(**host)
    gt = sandbox.run_calls(task["ground_truth"], task["test_cases"].items(), TIMEOUT)
    assert all(status == "ok" for status, _ in gt.values())

    t0 = time.monotonic()
    r = sandbox.grade_code(task, answer, timeout=TIMEOUT, gt_results=gt)
    elapsed = time.monotonic() - t0

    assert elapsed < TIMEOUT + 1, f"{name}: took {elapsed:.2f} s"
    assert r["verdicts"] == {t: expected for t in task["test_cases"]}, name
    assert open(host["canary"]).read() == "secret ground truth"
    with pytest.raises(BlockingIOError):
        host["listener"].accept()  # nothing reached the host's local port
    if sandbox._sandbox[1]:  # the sandbox drops to per-worker uids: none of them may be left running
        assert sandbox_processes() == [], f"{name}: processes left behind"
    # the machine is still healthy: processes start, and a correct answer passes right after
    assert subprocess.run(["true"]).returncode == 0
    assert sandbox.grade_code(task, task["ground_truth"], timeout=TIMEOUT, gt_results=gt)["success"]


def test_verdicts_are_deterministic():
    """Fixed PYTHONHASHSEED: a set's order is the same in every sandbox."""
    runs = [sandbox.run_calls("def h():\n    return [str(x) for x in {'a', 'b', 'c', 'd', 'e', 'f'}]", [("t", "h()")])
            for _ in range(3)]
    assert runs[0] == runs[1] == runs[2] and runs[0]["t"][0] == "ok"


def test_infrastructure_error_never_aborts(monkeypatch):
    """A sandbox that cannot start is a verdict, not an exception that ends the run."""
    monkeypatch.setattr(sandbox, "_sandbox", (["/nonexistent/bwrap"], False, False))
    r = sandbox.grade_code(DOUBLE, OK, timeout=TIMEOUT, gt_results={t: ("ok", v) for t, v in
                                                                  zip(DOUBLE["test_cases"], (2, 4, 6))})
    assert set(r["verdicts"].values()) == {"infrastructure"} and r["reward"] == 0


PIDS = "/sys/fs/cgroup/pids"


@pytest.mark.skipif(not (os.access(PIDS, os.W_OK) and os.path.exists(f"{PIDS}/cgroup.procs")),
                    reason="needs root and cgroup v1 pids (the sandbox's fork cap)")
def test_killed_stage_cgroups_are_removed(tmp_path):
    """A stage killed with SIGKILL skips its cleanup and leaves sweetrl-PID pids cgroups behind; the next stage's
    first sandbox removes those of dead PIDs that are empty, and leaves a group that still holds a process."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    empty, held = (f"{PIDS}/sweetrl-{pid}" for pid in (dead.pid, dead.pid + 10**7))  # the second PID cannot exist
    sleeper = None
    try:
        for base in (empty, held):
            os.makedirs(f"{base}/0")
        sleeper = subprocess.Popen(["sleep", "60"])
        with open(f"{held}/0/cgroup.procs", "w") as f:
            f.write(str(sleeper.pid))
        code = "from colbench import sandbox; print(sandbox.run_calls('def f():\\n    return 1', [('t', 'f()')])['t'][0])"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             cwd=os.path.dirname(os.path.dirname(sandbox.__file__)))
        assert out.stdout.strip() == "ok", out.stderr
        assert not os.path.exists(empty)  # removed, the child group first
        assert os.path.isdir(f"{held}/0") and sleeper.poll() is None  # not empty: kept, and nothing killed
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
        for base in (empty, held):
            for d in (f"{base}/0", base):
                for _ in range(50):
                    try:
                        os.rmdir(d)
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.02)
