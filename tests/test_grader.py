"""The grader's scoring rules (hostile answers: tests/test_sandbox.py)."""
import sandbox

TASK = {"ground_truth": "def f(x):\n    return x * 2\n", "test_cases": {"t1": "f(1)", "t2": "f(2)", "t3": "f('a')"}}


def grade(answer, **kw):
    return sandbox.grade_code(TASK, answer, timeout=kw.pop("timeout", 3), **kw)


def test_pass_fail_and_fences():
    assert grade("def f(x):\n    return x + x")["success"]
    assert grade("```python\ndef f(x):\n    return x * 2\n```")["success"]
    r = grade("def f(x):\n    return 2 if x == 1 else 0")
    assert (r["passed"], r["reward"], r["success"]) == (1, 1 / 3, False)


def test_none_results_never_pass():
    task = {"ground_truth": "def f(x):\n    return None\n", "test_cases": {"t": "f(1)"}}
    assert sandbox.grade_code(task, "def f(x):\n    return None")["passed"] == 0


def test_exceptions_fail_only_their_tests():
    r = grade("def f(x):\n    if x == 2: raise ValueError\n    return x * 2")
    assert r["passed"] == 2
    assert grade("this is not python")["passed"] == 0


def test_released_semantics_quirks():
    helper = "def h(x):\n    return x * 2\ndef f(x):\n    return h(x)"
    assert grade(helper)["success"]
    assert grade(helper, released=True)["passed"] == 0  # exec inside a function: NameError on h
    assert not grade("def f(x):\n    # open( is mentioned\n    return x * 2", released=True)["success"]


def test_results_compared_as_plain_data():
    task = {"ground_truth": "def f():\n    return {'a': [1, (2, 3)], 'b': {4}}\n", "test_cases": {"t": "f()"}}
    assert sandbox.grade_code(task, "def f():\n    return {'b': {4}, 'a': [1.0, (2, 3)]}")["success"]
    assert not sandbox.grade_code(task, "def f():\n    return {'b': {4}, 'a': [1, [2, 3]]}")["success"]
