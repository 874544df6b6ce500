"""The sandboxed grader: released semantics, and hostile answers scored as failures."""
import time

import common

TASK = {"ground_truth": "def f(x):\n    return x * 2\n", "test_cases": {"t1": "f(1)", "t2": "f(2)", "t3": "f('a')"}}


def grade(answer, **kw):
    return common.grade_code(TASK, answer, timeout=kw.pop("timeout", 3), **kw)


def test_pass_fail_and_fences():
    assert grade("def f(x):\n    return x + x")["success"]
    assert grade("```python\ndef f(x):\n    return x * 2\n```")["success"]
    r = grade("def f(x):\n    return 2 if x == 1 else 0")
    assert (r["passed"], r["reward"], r["success"]) == (1, 1 / 3, False)


def test_none_results_never_pass():
    task = {"ground_truth": "def f(x):\n    return None\n", "test_cases": {"t": "f(1)"}}
    assert common.grade_code(task, "def f(x):\n    return None")["passed"] == 0


def test_exceptions_fail_only_their_tests():
    r = grade("def f(x):\n    if x == 2: raise ValueError\n    return x * 2")
    assert r["passed"] == 2
    assert grade("this is not python")["passed"] == 0


def test_hostile_answers_fail_and_the_run_goes_on():
    t0 = time.time()
    loop = grade("def f(x):\n    while True: pass", timeout=2)
    assert loop["passed"] == 0 and loop["timeouts"] == 3
    assert time.time() - t0 < 10
    assert grade("import os\nos._exit(0)")["passed"] == 0
    assert grade("def f(x):\n    print('y' * 10**8)\n    return x * 2")["success"]  # prints go nowhere
    assert grade("import sys\ndef f(x):\n    sys.stdout.write('z' * 10**7)\n    return x * 2")["success"]
    assert grade("class A:\n    def __eq__(s, o): return True\ndef f(x):\n    return A()")["passed"] == 0
    assert grade("import os\ndef f(x):\n    os.fork()\n    return x * 2")["passed"] == 0
    assert grade("import os\nwhile True:\n    try: os.fork()\n    except Exception: pass", timeout=2)["passed"] == 0
    assert grade("x = ' ' * (4 * 10**9)\ndef f(x):\n    return x * 2")["passed"] == 0  # memory limit
    assert grade("def f(x):\n    import sys; sys.exit(0)")["passed"] == 0


def test_sandbox_has_no_network_and_no_writes(tmp_path):
    code = (f"import socket\ndef f(x):\n    try:\n        open({str(tmp_path / 'pwned')!r}, 'w').write('x')\n"
            "    except OSError:\n        pass\n    return x * 2\n")
    assert grade(code)["success"]
    assert not (tmp_path / "pwned").exists()


def test_released_semantics_quirks():
    helper = "def h(x):\n    return x * 2\ndef f(x):\n    return h(x)"
    assert grade(helper)["success"]
    assert grade(helper, released=True)["passed"] == 0  # exec inside a function: NameError on h
    assert not grade("def f(x):\n    # open( is mentioned\n    return x * 2", released=True)["success"]


def test_results_compared_as_plain_data():
    task = {"ground_truth": "def f():\n    return {'a': [1, (2, 3)], 'b': {4}}\n", "test_cases": {"t": "f()"}}
    assert common.grade_code(task, "def f():\n    return {'b': {4}, 'a': [1.0, (2, 3)]}")["success"]
    assert not common.grade_code(task, "def f():\n    return {'b': {4}, 'a': [1, [2, 3]]}")["success"]
