"""--prompt_dir: a folder of prompt templates (written here for the tests) replaces ours, in the
released message format, and the scripted human still finds the hidden information."""
import json
import subprocess
import sys
import threading

import pytest

import colbench
import colbench.human
from machinery import models
import simulator
from conftest import ROOT, read_jsonl, run_script

AGENT = "TEST AGENT TEMPLATE. Ask about what you need, then answer with the marker. {dialogue_history}"
HUMAN = ("TEST HUMAN TEMPLATE {{literal braces}}\nWhat you asked for: {problem_description}\n"
         "The conversation:\n{dialogue_history}\n--- known only to you ---\n{hidden_information}\n--- end ---\n"
         "Reply in one sentence.")
TASK = {"problem_description": "Write f.", "hidden_information": "The factor is 3.\nNegative inputs give 0.",
        "ground_truth": "def f(x):\n    return 3 * x", "test_cases": {"t": "f(1)"}}


def write_templates(d, released_names=True):
    d.mkdir(exist_ok=True)
    agent, human = ("llm_agent_code_prompt.txt", "human_simulator_code_prompt.txt") if released_names else \
        ("agent_code.txt", "human_code.txt")
    (d / agent).write_text(AGENT)
    (d / human).write_text(HUMAN)
    return d


def test_released_message_format_and_its_inverse(tmp_path):
    prompts = colbench.load_prompts(write_templates(tmp_path / "p", released_names=False))
    dialogue = [{"role": "user", "content": "Write f."}, {"role": "assistant", "content": "What factor?"},
                {"role": "user", "content": "The factor is 3."}, {"role": "assistant", "content": "And negatives?"}]
    msgs = colbench.human_messages(TASK, dialogue, prompts=prompts)
    assert [m["role"] for m in msgs] == ["system", "user"] and msgs[0]["content"] == "You are a helpful assistant."
    expected_history = ("user:Write f.\n\n\n\nassistant:What factor?\n\n\n\nuser:The factor is 3.\n\n\n\n"
                        "assistant:And negatives?\n\n\n\nagent:")
    assert msgs[1]["content"] == ("TEST HUMAN TEMPLATE {literal braces}\nWhat you asked for: Write f.\nThe conversation:\n"
                                  f"{expected_history}\n--- known only to you ---\nThe factor is 3.\nNegative inputs give 0."
                                  "\n--- end ---\nReply in one sentence.")
    assert colbench.parse_templated(prompts["human"], msgs[1]["content"]) == (TASK["hidden_information"], "And negatives?")
    assert colbench.parse_templated(prompts["human"], "some other prompt") is None
    agent = colbench.agent_messages(TASK, dialogue, prompts=prompts)
    assert agent[0] == {"role": "system", "content": AGENT}  # verbatim, as released
    assert agent[1:] == dialogue
    # the scripted human answers from the template's hidden information
    assert colbench.human.ScriptedHuman(prompts["human"]).chat(msgs) == "Negative inputs give 0."
    assert colbench.human.ScriptedHuman().chat(msgs) == "I don't know, sorry."  # without the template it cannot


def test_rollout_with_released_names_end_to_end(task_files, tiny_model, tmp_path):
    """The oracle against the scripted human, both on the folder's templates: the human reveals every
    fact, every answer passes, and the agent's stored input starts from the template."""
    d = write_templates(tmp_path / "prompts")
    server = simulator.serve(simulator.Args(port=0, prompt_dir=str(d)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _, test = task_files
        run_script("rollout.py", "--tasks", test, "--num_tasks", "4", "--output", tmp_path / "o.jsonl",
                   "--simulator_url", f"http://127.0.0.1:{server.server_address[1]}", "--agent_backend", "oracle",
                   "--agent_model", tiny_model, "--prompt_dir", d)
    finally:
        server.shutdown()
    run_script("evaluate.py", "--input", tmp_path / "o.jsonl", "--output", tmp_path / "g.jsonl", "--summary", tmp_path / "s.json")
    assert json.loads((tmp_path / "s.json").read_text())["success_rate"] == 1.0
    tok = models.load_tokenizer(tiny_model)
    for r in read_jsonl(tmp_path / "g.jsonl"):
        said = " ".join(m["content"] for m in r["dialogue_history"] if m["role"] == "user")
        assert all(fact in said for fact in r["task"]["hidden_information"].splitlines())
        first = next(m for m in r["dialogue_history"] if m["role"] == "assistant")
        assert first["input"] == models.render_prompt(tok, [{"role": "system", "content": AGENT},
                                                            {"role": "user", "content": r["task"]["problem_description"]}])
    settings = json.loads((tmp_path / "o.jsonl.run_settings.json").read_text())
    assert settings["prompt_dir"] == str(d)


@pytest.mark.parametrize("broken, message", [
    ({"human_simulator_code_prompt.txt": None}, "no human template for code tasks (expected human_code.txt or "
                                                "human_simulator_code_prompt.txt)"),
    ({"human_simulator_code_prompt.txt": "Answer: {dialogue_history}"}, "must contain {hidden_information}"),
    ({"human_simulator_code_prompt.txt": "{hidden_information} {name}"}, "may use only {problem_description}"),
])
def test_bad_template_folder_is_one_clear_line(tmp_path, task_files, tiny_model, broken, message):
    d = write_templates(tmp_path / "p")
    for name, text in broken.items():
        (d / name).unlink() if text is None else (d / name).write_text(text)
    _, test = task_files
    p = subprocess.run([sys.executable, "rollout.py", "--tasks", str(test), "--output", str(tmp_path / "o.jsonl"),
                        "--agent_backend", "oracle", "--agent_model", tiny_model, "--prompt_dir", str(d)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode != 0 and "Traceback" not in p.stderr and message in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "o.jsonl").exists()  # refused before any work
