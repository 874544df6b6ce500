"""Bad input: every stage checks its input up front and names the file and line; settings that
can't work together are refused before any work (no model is loaded, no output is touched)."""
import json
import subprocess
import sys
import types

import pytest

import colbench
from colbench import grade
import common
import evaluate
import label_turns
import rollout
import train_critic
import train_dpo
from conftest import ROOT

TASK = {"problem_description": "Write f.", "hidden_information": "Double it.",
        "ground_truth": "def f(x):\n    return x * 2\n", "test_cases": {"a": "f(1)"}}
TURN = {"role": "assistant", "content": "hi", "input": "<prompt>", "output": "hi"}
TRAJ = {"task": TASK, "dialogue_history": [{"role": "user", "content": "Write f."}, TURN], "answer": "hi", "reward": 1.0}


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def fails_with(fn, *args, match):
    with pytest.raises((common.DataError, SystemExit), match=match):
        fn(*args)


def test_malformed_files_name_file_and_line(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"finished": "work"}\n')
    broken = write(tmp_path / "tasks.jsonl", [TASK, TASK, '{"problem_description": "x",'])
    fails_with(rollout.main, rollout.Args(tasks=str(broken), output=str(out)), match=r"tasks.jsonl:3: not valid JSON")
    missing = write(tmp_path / "tasks2.jsonl", [TASK, {k: v for k, v in TASK.items() if k != "test_cases"}])
    fails_with(rollout.main, rollout.Args(tasks=str(missing), output=str(out)),
               match=r"tasks2.jsonl:2: missing field 'test_cases'")
    assert out.read_text() == '{"finished": "work"}\n'  # nothing finished is touched

    bad_turn = dict(TRAJ, dialogue_history=[{"role": "user", "content": "x"}, {"content": "no role"}])
    traj = write(tmp_path / "traj.jsonl", [TRAJ, bad_turn])
    fails_with(grade.load_trajectories, traj, match=r"traj.jsonl:2: dialogue_history\[1\] must be")
    no_answer = write(tmp_path / "traj2.jsonl", [{k: v for k, v in TRAJ.items() if k != "answer"}])
    fails_with(grade.load_trajectories, no_answer, match=r"traj2.jsonl:1: missing field 'answer'")
    bad_tests = write(tmp_path / "traj3.jsonl", [TRAJ, dict(TRAJ, task=dict(TASK, test_cases={"a": 3}))])
    fails_with(grade.load_trajectories, bad_tests, match=r"traj3.jsonl:2: test case 'a' must be")

    graded = write(tmp_path / "g.jsonl", [TRAJ, TRAJ, {k: v for k, v in TRAJ.items() if k != "reward"}])
    fails_with(colbench.load_graded, graded, match=r"g.jsonl:3: missing 'reward'")
    text_reward = write(tmp_path / "g2.jsonl", [dict(TRAJ, reward="1.0")])
    fails_with(colbench.load_graded, text_reward, match=r"g2.jsonl:1: 'reward' must be a number")
    no_inputs = write(tmp_path / "g3.jsonl", [dict(TRAJ, dialogue_history=[{"role": "assistant", "content": "x"}])])
    fails_with(colbench.load_graded, no_inputs, match=r"g3.jsonl:1: no assistant turn with stored 'input'")

    pairs = write(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"},
                                             {"prompt": "p", "chosen": ["a"], "rejected": "b"}])
    fails_with(train_dpo.build_examples, train_dpo.Args(output_dir=str(tmp_path / "o"), pairs=str(pairs)),
               match=r"pairs.jsonl:2: 'chosen' must be a string")


def test_settings_that_clash_are_refused_before_work(tmp_path):
    g = str(write(tmp_path / "g.jsonl", [TRAJ]))
    o = str(tmp_path / "o")
    fails_with(train_dpo.main, train_dpo.Args(output_dir=o, mode="turn", trajectories=g),
               match="--mode turn needs --pairs")
    fails_with(train_dpo.main, train_dpo.Args(output_dir=o, mode="sft", trajectories=g, resume=True),
               match="--resume: nothing to resume")
    fails_with(train_critic.main, train_critic.Args(trajectories=g, output_dir=o, heldout_fraction=1.0, lr=0),
               match=r"--lr must be positive\n.*--heldout_fraction")
    fails_with(label_turns.main, label_turns.Args(trajectories=g, critic=o, output=o, num_candidates=1),
               match="--num_candidates must be at least 2")
    fails_with(label_turns.main, label_turns.Args(trajectories=g, critic=o, output=o), match="no run_settings.json")
    fails_with(rollout.main, rollout.Args(tasks=g, output=o, agent_backend="openai"), match="needs --agent_url")
    fails_with(evaluate.main, evaluate.Args(input=g, reference=g), match="--reference .* applies to --task_type html")
    assert not (tmp_path / "o").exists()


def test_a_stage_prints_one_clear_line_not_a_traceback(tmp_path):
    bad = write(tmp_path / "t.jsonl", [TRAJ, "not json"])
    p = subprocess.run([sys.executable, "evaluate.py", "--input", str(bad)], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip() == f"error: {bad}:2: not valid JSON (Expecting value; column 1)"


def test_unwritable_output_fails_before_any_work(tmp_path, task_files):
    """evaluate.py (and every stage) checks its outputs first: one line, no traceback, nothing graded."""
    import subprocess
    import sys
    train, _ = task_files
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for flag in ("--output", "--summary"):
        p = subprocess.run([sys.executable, "evaluate.py", "--input", str(train), flag, str(blocker / "x.json")],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert p.returncode != 0 and "Traceback" not in p.stderr and "ground truths" not in p.stderr, p.stderr
        assert p.stderr.strip().splitlines()[-1].startswith(f"error: {blocker / 'x.json'}: cannot write there")
    p = subprocess.run([sys.executable, "train_dpo.py", "--mode", "sft", "--trajectories", str(train), "--output_dir",
                        str(blocker / "out")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode != 0 and "cannot write there" in p.stderr and "Traceback" not in p.stderr


def test_critics_name_their_pi_ref_from_where_they_trained(tmp_path, monkeypatch):
    """A critic's pi_ref is a path as train_critic.py was given it: a relative one is read from the directory it
    ran in (run_settings' cwd), so critics trained from different directories, or named absolutely, are one pi_ref;
    a different pi_ref is still refused."""
    (tmp_path / "run" / "policy").mkdir(parents=True)
    (tmp_path / "other").mkdir()

    def critic(name, model, cwd):
        settings = {"model": model, "beta": 0.1}
        if cwd:
            settings["cwd"] = str(cwd)
        (tmp_path / name).mkdir()
        (tmp_path / name / "run_settings.json").write_text(json.dumps(settings))
        return str(tmp_path / name)

    monkeypatch.chdir(tmp_path / "run")  # every stage's run_settings.json records where its relative paths start
    common.save_run_settings(tmp_path / "s.json", types.SimpleNamespace(model="policy"))
    assert json.loads((tmp_path / "s.json").read_text())["cwd"] == str(tmp_path / "run")
    monkeypatch.chdir(tmp_path / "other")  # labelling from a third directory: "policy" exists nowhere here
    dirs = {"a": critic("a", "policy", tmp_path / "run"), "b": critic("b", str(tmp_path / "run" / "policy"), None),
            "c": critic("c", "run/policy", tmp_path)}
    settings, ref = label_turns.load_critics(dirs)
    assert ref == str((tmp_path / "run" / "policy").resolve()) and set(settings) == {"a", "b", "c"}
    # a critic of another starting point, or one whose relative path never existed where it trained
    (tmp_path / "run" / "other_policy").mkdir()
    fails_with(label_turns.load_critics, {**dirs, "d": critic("d", "other_policy", tmp_path / "run")},
               match="critic d starts from other_policy.*one pi_ref for all")
    fails_with(label_turns.load_critics, {**dirs, "e": critic("e", "policy", tmp_path)}, match="critic e starts from policy")
    # a hub id or the embedded model is a name, compared as it is
    (tmp_path / "embedded").mkdir()  # even beside a folder of that name, as resolve_model reads it
    assert label_turns.load_critics({"x": critic("x", "embedded", tmp_path)})[1] == "embedded"
