"""The grader's scoring rules (hostile answers: tests/test_sandbox.py)."""
import pytest

from colbench import sandbox

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
    for banned in sandbox.RELEASED_BLACKLIST:  # exactly the released list, checked on the raw answer
        assert not grade(f"def f(x):\n    # {banned} is mentioned\n    return x * 2", released=True)["success"]
    assert grade("def f(x):\n    # open( is not on the released list\n    return x * 2", released=True)["success"]
    # released fences: the text between the first ```python and the next ```
    assert grade("Here:\n```python\ndef f(x):\n    return x * 2\n```\nthanks", released=True)["success"]
    # released timeouts: each answer test has 1 s (an alarm); the others still count
    slow = "def f(x):\n    if x == 2:\n        while True: pass\n    return x * 2"
    r = grade(slow, released=True, timeout=5)
    assert (r["passed"], r["verdicts"]["t2"]) == (2, "timeout")


def test_results_compared_as_plain_data():
    task = {"ground_truth": "def f():\n    return {'a': [1, (2, 3)], 'b': {4}}\n", "test_cases": {"t": "f()"}}
    assert sandbox.grade_code(task, "def f():\n    return {'b': {4}, 'a': [1.0, (2, 3)]}")["success"]
    assert not sandbox.grade_code(task, "def f():\n    return {'b': {4}, 'a': [1, [2, 3]]}")["success"]


# (ground truth, answer, the released grader's `==`): results of any type the released grader compares
# with == compare the same way here, though each side is decoded from its own sandboxed process
TYPED = [
    ("import collections\ndef f():\n    return collections.Counter('aab')", "def f():\n    return {'a': 2, 'b': 1}", True),
    ("import collections\ndef f():\n    return collections.OrderedDict([(1, 2), (3, 4)])",
     "import collections\ndef f():\n    return collections.OrderedDict([(3, 4), (1, 2)])", False),
    ("import collections\ndef f():\n    return collections.OrderedDict([(1, 2), (3, 4)])", "def f():\n    return {3: 4, 1: 2}", True),
    ("import collections\ndef f():\n    return collections.defaultdict(int, a=1)", "def f():\n    return {'a': 1}", True),
    ("import collections\ndef f():\n    P = collections.namedtuple('P', 'x y')\n    return P(1, 2)", "def f():\n    return (1, 2)", True),
    ("def f():\n    return {1, 2}", "def f():\n    return frozenset({1, 2})", True),
    ("import datetime\ndef f():\n    return datetime.date(2020, 1, 2)", "import datetime\ndef f():\n    return datetime.date(2020, 1, 3)", False),
    ("import datetime as d\ndef f():\n    return d.datetime(2020, 1, 2, 3, tzinfo=d.timezone.utc)",
     "import datetime as d\ndef f():\n    return d.datetime(2020, 1, 2, 4, tzinfo=d.timezone(d.timedelta(hours=1)))", True),
    ("import datetime\ndef f():\n    return datetime.timedelta(days=1)", "import datetime\ndef f():\n    return datetime.timedelta(hours=24)", True),
    ("from decimal import Decimal\ndef f():\n    return Decimal('1.5')", "def f():\n    return 1.5", True),
    ("from fractions import Fraction\ndef f():\n    return Fraction(1, 3)", "def f():\n    return 1 / 3", False),
    ("def f():\n    return 1 + 0j", "def f():\n    return 1", True),
    ("import numpy as np\ndef f():\n    return np.int64(3)", "def f():\n    return 3", True),
    ("import numpy as np\ndef f():\n    return np.float32(0.5)", "def f():\n    return 0.25", False),
    ("import numpy as np\ndef f():\n    return np.array([1, 2])", "import numpy as np\ndef f():\n    return np.array([1, 2])", False),
    ("import numpy as np\ndef f():\n    return np.array([7])", "def f():\n    return 7", True),
    ("def f():\n    return int", "def f():\n    return int", True),
    ("def f():\n    return int", "def f():\n    return float", False),
    ("def f():\n    class A: pass\n    return A", "def f():\n    class A: pass\n    return A", False),
]


@pytest.mark.parametrize("gt, answer, equal", TYPED, ids=range(len(TYPED)))
def test_results_of_any_type_compare_as_released(gt, answer, equal):
    task = {"ground_truth": gt, "test_cases": {"t": "f()"}}
    assert sandbox.run_calls(gt, [("t", "f()")], trusted=True)["t"][0] == "ok"  # the ground truth is judged
    assert sandbox.grade_code(task, answer, timeout=5)["success"] is equal


def test_untrusted_types_never_decide():
    """An answer's own class, whatever its __eq__, __class__ or __module__, never equals a result."""
    task = {"ground_truth": "def f():\n    return (1, 2)", "test_cases": {"t": "f()"}}
    liars = ["class T(tuple):\n    def __eq__(self, o): return True\ndef f():\n    return T((9,))",
             "class Int(type):\n    pass\nclass X(metaclass=Int):\n    __module__ = 'builtins'\n    __qualname__ = 'int'\n"
             "def f():\n    return X"]
    for code in liars:
        assert not sandbox.grade_code(task, code, timeout=5)["success"]
    task = {"ground_truth": "def f():\n    return int", "test_cases": {"t": "f()"}}
    assert not sandbox.grade_code(task, liars[1], timeout=5)["success"]
