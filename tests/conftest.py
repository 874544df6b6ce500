"""Shared fixtures: a tiny random Llama with a real (tiny, trained-here) ChatML tokenizer, procedural
task files, and the embedded simulator running as a real HTTP server on a free localhost port."""
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_model(out_dir, seed=0, bos=False, tie=False, hidden_size=32):
    """bos=True: a Llama-3-like tokenizer that adds <|begin_of_text|> to every encoding (unless
    add_special_tokens=False) and a chat template that writes it too. 4 heads of hidden_size / 4 (vLLM's CPU
    attention takes heads of 32 or more)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = ["def f(x):\n    return x * 2\n", "I WANT TO ANSWER:", "What is the value? I don't know.",
              "The message starts with 'Hello'.", "A score of 70 or more gets the label 'pass'."] * 20
    specials = ["<pad>", "<|im_start|>", "<|im_end|>"] + (["<|begin_of_text|>"] if bos else [])
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tk.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                                          special_tokens=[("<|begin_of_text|>", tk.token_to_id("<|begin_of_text|>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<pad>",
                                  bos_token="<|begin_of_text|>" if bos else None)
    tok.chat_template = ("{{ bos_token }}" if bos else "") + CHATML
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def simulator_url():
    """The scripted simulator as a real server in this process (a thread), on a free port."""
    import simulator
    server = simulator.serve(simulator.Args(port=0))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="session")
def task_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    run_script("generate_tasks.py", "--num_tasks", "12", "--seed", "1", "--output", d / "test.jsonl")
    run_script("generate_tasks.py", "--num_tasks", "30", "--seed", "0", "--exclude", d / "test.jsonl", "--output", d / "train.jsonl")
    return d / "train.jsonl", d / "test.jsonl"


def run_script(script, *args, env=None, timeout=600):
    """Run a stage as a user would (a subprocess); fail the test with its output if it fails."""
    p = subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, **(env or {})}, timeout=timeout)
    assert p.returncode == 0, f"{script} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def read_jsonl(path):
    return [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]


def saved_step(resume_dir):
    """The step of a training stage's last saved state (RESUME/meta.json), 0 before its first save. A save renames
    the old state aside and the new one into place (training.save_training_state), so a poll between the two renames
    finds no file: it reads as 0 too, not as an error."""
    try:
        return json.loads((Path(resume_dir) / "meta.json").read_text())["step"]
    except FileNotFoundError:
        return 0


def pytest_collection_modifyitems(items):
    """The whole-loop runs of run.sh (the three longest tests) first, so that the shorter tests fill the other
    worker beside them instead of one worker running a long test alone at the end."""
    items.sort(key=lambda item: item.path.name != "test_run_sh.py")
