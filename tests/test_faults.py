"""Fault injection with real processes: simulator servers killed, restarted, answering 500 or
hanging; stages killed with SIGKILL and rerun. Nothing finished may be lost or duplicated."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT, read_jsonl, run_script, saved_step
from test_training import write_graded

from machinery import models


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*cmd):
    p = subprocess.Popen([sys.executable, *map(str, cmd)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert "ready at" in p.stdout.readline()
    return p


def start_stage(script, *args):
    return subprocess.Popen([sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def lines(path):
    return open(path).read().count("\n") if os.path.exists(path) else 0


def wait_for_lines(path, n, proc, timeout=120):
    t0 = time.time()
    while lines(path) < n:
        assert proc.poll() is None, f"the stage ended before writing {n} lines:\n{proc.communicate()[1][-2000:]}"
        assert time.time() - t0 < timeout
        time.sleep(0.02)
    return lines(path)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return err


def oracle_rollout(tasks, out, url, model, *extra):
    return ["rollout.py", "--tasks", tasks, "--output", out, "--simulator_url", url, "--agent_backend", "oracle",
            "--agent_model", model, "--batch_size", "1", *extra]


def keys(rows):
    return [(r["task_id"], r["sample"]) for r in rows]


def test_simulator_killed_mid_rollout_and_restarted(task_files, tiny_model, tmp_path):
    train, _ = task_files
    port, out = free_port(), tmp_path / "r.jsonl"
    sim = start_server("simulator.py", "--port", port)
    ro = start_stage(*oracle_rollout(train, out, f"http://127.0.0.1:{port}", tiny_model, "--samples", "4",
                                     "--simulator_retry_s", "60"))
    try:
        at_kill = wait_for_lines(out, 5, ro)
        sim.kill()
        sim.wait()
        time.sleep(1.5)  # the rollout is retrying against a dead port now
        sim = start_server("simulator.py", "--port", port)
        finish(ro)
    finally:
        sim.kill()
    rows = read_jsonl(out)
    assert at_kill < 120 and len(rows) == 120 and len(set(keys(rows))) == 120
    assert all(r["finish"] == "answered" for r in rows)  # the outage cost time, not dialogues


def test_simulator_down_for_good_then_rerun(task_files, tiny_model, tmp_path):
    train, _ = task_files
    port, out = free_port(), tmp_path / "r.jsonl"
    cmd = oracle_rollout(train, out, f"http://127.0.0.1:{port}", tiny_model, "--samples", "4", "--simulator_retry_s", "1")
    sim = start_server("simulator.py", "--port", port)
    ro = start_stage(*cmd)
    wait_for_lines(out, 5, ro)
    sim.kill()
    sim.wait()
    err = finish(ro)
    rows = read_jsonl(out)
    failed = [r for r in rows if r["finish"] == "error"]
    assert len(rows) == 120 and failed, "every dialogue is written, failed ones marked"
    assert all("simulator" in r["error"] for r in failed) and "finish=error" in err
    good = [r for r in rows if r["finish"] != "error"]
    sim = start_server("simulator.py", "--port", port)
    try:
        err = finish(start_stage(*cmd))
    finally:
        sim.kill()
    rows = read_jsonl(out)
    assert f"{len(failed)} rows will be redone" in err
    assert len(rows) == 120 and len(set(keys(rows))) == 120 and all(r["finish"] == "answered" for r in rows)
    assert rows[:len(good)] == good  # finished dialogues kept as they were


@pytest.mark.parametrize("mode", ["500", "hang"])
def test_failing_simulator_marks_dialogues_and_a_rerun_finishes_them(mode, task_files, tiny_model, simulator_url,
                                                                      tmp_path):
    train, _ = task_files
    port, out = free_port(), tmp_path / "r.jsonl"
    bad = start_server(ROOT / "tests" / "fault_server.py", mode, port)
    try:
        t0 = time.time()
        run_script(*oracle_rollout(train, out, f"http://127.0.0.1:{port}", tiny_model, "--num_tasks", "3",
                                   "--batch_size", "3", "--simulator_timeout", "0.5", "--simulator_retry_s", "1.5"))
        assert time.time() - t0 < 60
    finally:
        bad.kill()
    rows = read_jsonl(out)
    assert len(rows) == 3 and all(r["finish"] == "error" for r in rows)
    assert all(("HTTP 500" if mode == "500" else "Timeout") in r["error"] for r in rows)
    run_script(*oracle_rollout(train, out, simulator_url, tiny_model, "--num_tasks", "3"))
    rows = read_jsonl(out)
    assert len(rows) == 3 and all(r["finish"] == "answered" for r in rows)


def test_rollout_killed_with_sigkill_then_rerun(task_files, tiny_model, simulator_url, tmp_path):
    train, _ = task_files
    out = tmp_path / "r.jsonl"
    cmd = oracle_rollout(train, out, simulator_url, tiny_model, "--samples", "4")
    ro = start_stage(*cmd)
    wait_for_lines(out, 10, ro)
    ro.send_signal(signal.SIGKILL)
    ro.wait()
    before = read_jsonl(out)
    assert 10 <= len(before) < 120
    with open(out, "a") as f:  # as if the kill had landed mid-write
        f.write(json.dumps(before[0])[:40])
    err = run_script(*cmd).stderr
    assert "half-written last line" in err
    rows = read_jsonl(out)
    assert len(rows) == 120 and len(set(keys(rows))) == 120 and rows[:len(before)] == before


def test_label_turns_killed_with_sigkill_then_rerun(tiny_model, tmp_path):
    tok = models.load_tokenizer(tiny_model)
    write_graded(tok, tmp_path / "g.jsonl", n_tasks=12)
    run_script("train_critic.py", "--trajectories", tmp_path / "g.jsonl", "--model", tiny_model, "--output_dir",
               tmp_path / "critic", "--lr", "1e-3", "--epochs", "1")
    out, states = tmp_path / "pairs.jsonl", f"{tmp_path / 'pairs.jsonl'}.states.jsonl"
    cmd = ["label_turns.py", "--trajectories", tmp_path / "g.jsonl", "--critic", tmp_path / "critic", "--output", out,
           "--num_candidates", "4", "--pairs_per_state", "2", "--max_new_tokens", "24"]
    p = start_stage(*cmd)
    wait_for_lines(states, 3, p)
    p.send_signal(signal.SIGKILL)
    p.wait()
    done = read_jsonl(states)
    run_script(*cmd)
    all_states = read_jsonl(states)
    skey = lambda r: (r["task_id"], r["sample"], r["turn"])
    assert all_states[:len(done)] == done and len(done) < len(all_states)
    assert len({skey(s) for s in all_states}) == len(all_states)  # each state labelled once
    pairs = read_jsonl(out)
    assert {skey(p) for p in pairs} <= {skey(s) for s in all_states}
    assert len({(*skey(p), p["chosen"], p["rejected"]) for p in pairs}) == len(pairs)


def test_training_killed_with_sigkill_resumes_to_the_same_weights(tiny_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    tok = models.load_tokenizer(tiny_model)
    write_graded(tok, tmp_path / "g.jsonl", n_tasks=12)
    args = lambda out, *extra: ["train_dpo.py", "--mode", "sft", "--trajectories", tmp_path / "g.jsonl", "--model",
                                tiny_model, "--output_dir", out, "--lr", "1e-3", "--epochs", "3", "--batch_size", "1",
                                "--save_minutes", "0", *extra]
    run_script(*args(tmp_path / "whole"))
    p = start_stage(*args(tmp_path / "killed"))
    t0 = time.time()
    while saved_step(tmp_path / "killed" / "resume") < 3:
        assert p.poll() is None and time.time() - t0 < 120
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    assert p.wait() == -signal.SIGKILL
    assert not (tmp_path / "killed" / "config.json").exists()  # no checkpoint that looks finished
    # settings that would change the data order are refused before any work
    bad = subprocess.run([sys.executable, *map(str, args(tmp_path / "killed", "--resume", "--seed", "7"))], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "--seed 0 (this run: 7)" in bad.stderr
    out = run_script(*args(tmp_path / "killed", "--resume")).stdout
    assert "resuming after step" in out
    whole, resumed = (read_jsonl(tmp_path / d / "log.jsonl") for d in ("whole", "killed"))
    assert [r["step"] for r in resumed] == list(range(1, 37))
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole], rel=1e-5)
    a, b = (AutoModelForCausalLM.from_pretrained(tmp_path / d) for d in ("whole", "killed"))
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a.parameters(), b.parameters()))
    assert not (tmp_path / "killed" / "resume").exists()  # cleaned up once the checkpoint is complete
