"""Task files: procedural generation, import with errors naming file and line."""
import json
import random

import pytest

import colbench
import colbench.tasks
import common
from colbench import sandbox
from conftest import ROOT, read_jsonl, run_script

# A plausible answer per family written WITHOUT the hidden facts (the obvious defaults a model guesses).
NAIVE = {
    "threshold": lambda fn, a: f"def {fn}({a[0]}):\n    return 'pass' if {a[0]} >= 50 else 'fail'",
    "fee": lambda fn, a: f"def {fn}({a[0]}):\n    return 10 * {a[0]}",
    "greeting": lambda fn, a: f"def {fn}({a[0]}):\n    return 'Hello, ' + {a[0]} + '!'",
    "convert": lambda fn, a: f"def {fn}({a[0]}):\n    return {a[0]} * 10",
    "aggregate": lambda fn, a: f"def {fn}({a[0]}):\n    return sum({a[0]})",
    "score": lambda fn, a: f"def {fn}({a[0]}, {a[1]}):\n    return {a[0]} * 3 + {a[1]}",
}


def test_procedural_is_deterministic_and_splits_are_disjoint(tmp_path):
    for name, seed in [("a", 3), ("b", 3), ("c", 4)]:
        run_script("generate_tasks.py", "--num_tasks", "40", "--seed", seed, "--output", tmp_path / f"{name}.jsonl")
    a, b, c = (read_jsonl(tmp_path / f"{n}.jsonl") for n in "abc")
    assert a == b and len(a) == 40
    assert a != c  # another seed, other tasks (a rare collision is possible: --exclude rules it out)
    run_script("generate_tasks.py", "--num_tasks", "40", "--seed", 4, "--exclude", tmp_path / "a.jsonl",
               "--output", tmp_path / "d.jsonl")
    d = read_jsonl(tmp_path / "d.jsonl")
    assert len(d) == 40 and not {t["task_id"] for t in a} & {t["task_id"] for t in d}  # --exclude guarantees disjoint splits
    # a task is its description and hidden facts, whatever its tests: one with other tests is still excluded
    other_tests = [dict(a[0], test_cases={"other": "f(0)"}, task_id="another id"), *a[1:]]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(t) + "\n" for t in other_tests))
    run_script("generate_tasks.py", "--num_tasks", "40", "--seed", 3, "--exclude", tmp_path / "a.jsonl",
               "--output", tmp_path / "e.jsonl")
    e = read_jsonl(tmp_path / "e.jsonl")
    assert not {colbench.task_identity(t) for t in a} & {colbench.task_identity(t) for t in e}
    # --split: one draw's test tasks are never another draw's train tasks, whatever the seeds
    for split, seed in [("test", 1), ("train", 1), ("train", 2)]:
        run_script("generate_tasks.py", "--num_tasks", "30", "--seed", seed, "--split", split,
                   "--output", tmp_path / f"{split}{seed}.jsonl")
    test = {colbench.task_identity(t) for t in read_jsonl(tmp_path / "test1.jsonl")}
    train = {colbench.task_identity(t) for s in (1, 2) for t in read_jsonl(tmp_path / f"train{s}.jsonl")}
    assert len(test) == 30 and len(train) >= 30 and not test & train
    assert {colbench.task_split(t) for t in read_jsonl(tmp_path / "test1.jsonl")} == {"test"}
    for t in a:
        assert t["problem_description"].split("The signature of the function is: def ")[1].startswith(t["ground_truth"][4:].split(":")[0])
        assert len(t["test_cases"]) == 10 and all(l.strip() for l in t["hidden_information"].splitlines())


def test_every_family_needs_its_hidden_facts():
    rng = random.Random(0)
    for family, naive in NAIVE.items():
        fails = 0
        for _ in range(6):
            t = colbench.tasks.procedural_task(rng, family)
            sig = t["problem_description"].split("def ")[-1]
            fn, args = sig.split("(")[0], [a.strip() for a in sig.split("(")[1].rstrip(")").split(",")]
            gt = sandbox.run_calls(t["ground_truth"], list(t["test_cases"].items()))
            assert sandbox.grade_code(t, t["ground_truth"], gt_results=gt)["success"]
            fails += not sandbox.grade_code(t, naive(fn, args), gt_results=gt)["success"]
        assert fails == 6, f"{family}: a guess without the facts passed {6 - fails}/6 tasks"


def test_file_source_reports_bad_lines(tmp_path):
    good = colbench.tasks.procedural_task(random.Random(1))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(good) + "\n" + "{not json\n")
    with pytest.raises(common.DataError, match=r"bad.jsonl:2: not valid JSON"):
        colbench.load_tasks(bad)
    bad.write_text(json.dumps(good) + "\n" + json.dumps({k: v for k, v in good.items() if k != "test_cases"}) + "\n")
    with pytest.raises(common.DataError, match=r"bad.jsonl:2: missing field 'test_cases'"):
        colbench.load_tasks(bad)
    p = __import__("subprocess").run([__import__("sys").executable, "generate_tasks.py", "--source", "file", "--input",
                                      str(bad), "--output", str(tmp_path / "o.jsonl")], capture_output=True, text=True,
                                     cwd=common.Path(common.__file__).parent)
    assert p.returncode != 0 and "bad.jsonl:2" in p.stderr


def test_file_source_reads_jsonl_and_datasets_dirs(tmp_path):
    import datasets
    tasks = [colbench.tasks.procedural_task(random.Random(i)) for i in range(5)]
    for t in tasks:
        t.pop("family")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    run_script("generate_tasks.py", "--source", "file", "--input", tmp_path / "in.jsonl", "--output", tmp_path / "out.jsonl")
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [{k: t[k] for k in tasks[0]} for t in out] == tasks and all(len(t["task_id"]) == 12 for t in out)
    datasets.Dataset.from_list([dict(t, test_cases=json.dumps(t["test_cases"])) for t in tasks]).save_to_disk(tmp_path / "ds")
    assert [t["task_id"] for t in colbench.load_tasks(tmp_path / "ds")] == [t["task_id"] for t in out]


def test_colbench_files_give_every_train_task_and_the_first_thousand_test_tasks(tmp_path):
    """The at-scale command's data: config/colbench.sh's N_TEST (1,000 unless set) and run.sh's two calls of
    generate_tasks.py on a 1,200-task test file and a 700-task train file."""
    import subprocess
    root = common.Path(common.__file__).parent
    sh = subprocess.run(["bash", "-c", ". config/colbench.sh; echo $N_TEST $N_VAL $N_WARMUP"], cwd=root, text=True,
                        capture_output=True, env={"PATH": "/usr/bin:/bin"}, check=True)
    assert sh.stdout.split() == ["1000", "0", "0"]  # N_TEST, and no validation or warm-up tasks taken from train
    n_test = int(sh.stdout.split()[0])
    tasks = [{"problem_description": f"Write f{i}(x).", "hidden_information": f"Add {i}.", "ground_truth":
              f"def f{i}(x):\n    return x + {i}\n", "test_cases": {"a": f"f{i}(1)"}} for i in range(1900)]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks[:1200]))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks[1200:]))
    run_script("generate_tasks.py", "--source", "file", "--input", tmp_path / "test.jsonl", "--num_tasks", n_test,
               "--output", tmp_path / "t.jsonl")
    run_script("generate_tasks.py", "--source", "file", "--input", tmp_path / "train.jsonl", "--num_tasks", 0,
               "--exclude", tmp_path / "t.jsonl", "--output", tmp_path / "tr.jsonl")
    test, train = read_jsonl(tmp_path / "t.jsonl"), read_jsonl(tmp_path / "tr.jsonl")
    assert [t["problem_description"] for t in test] == [t["problem_description"] for t in tasks[:1000]]
    assert [t["problem_description"] for t in train] == [t["problem_description"] for t in tasks[1200:]]


def test_the_readme_colbench_snippet_runs_as_written():
    """README's "ColBench as a package": the documented API (tasks, the human's reply, the sandboxed grade) in a fresh
    interpreter from the project folder, with the output its comment shows."""
    import subprocess
    import sys
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## ColBench as a package"):]
    code = section[section.index("```python\n") + 10:section.index("\n```", section.index("```python"))]
    out = subprocess.run([sys.executable, "-"], input=code, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == code.rsplit("# ", 1)[1].strip()  # "One shelf holds 36 books. True 1.0"
