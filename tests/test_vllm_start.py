"""The vllm backend's engine starts before anything asks torch about CUDA, in labelling and in rollouts.

A CUDA query (even torch.cuda.is_available()) initialises the driver in the stage's process, and vLLM's engine
process, forked from it, then fails with "Cannot re-initialize CUDA in forked subprocess". That failure needs a
GPU (the real engine on this CPU: tests/test_vllm.py), so a stand-in `vllm` module takes its place: it checks the
contract a stage must keep when it builds `LLM(...)` (no CUDA query before, workers started by spawn, torchrun's
variables hidden, token-id prompts, one seed per request) and samples real text from the model it is given with
transformers.
"""
import json
import shutil
import sys
import types

import pytest
import torch

import label_turns
from machinery import models
import rollout
from test_training import write_graded


class CudaQueries:
    """Records every call of torch.cuda's device queries (they still answer as before)."""
    NAMES = ("is_available", "device_count", "current_device", "get_device_properties", "mem_get_info", "set_device",
             "init", "_lazy_init")

    def __init__(self, monkeypatch):
        self.calls = []
        for name in self.NAMES:
            original = getattr(torch.cuda, name)
            monkeypatch.setattr(torch.cuda, name, self.recording(name, original))

    def recording(self, name, original):
        def query(*args, **kwargs):
            self.calls.append(name)
            return original(*args, **kwargs)
        return query


def standin_vllm(cuda, engines):
    """A `vllm` module with LLM and SamplingParams, as the stages call them."""
    import os
    from transformers import AutoModelForCausalLM

    class SamplingParams:
        def __init__(self, seed=None, temperature=1.0, top_p=1.0, max_tokens=16):
            assert isinstance(seed, int), "every request has its own seed"
            self.seed, self.temperature, self.top_p, self.max_tokens = seed, temperature, top_p, max_tokens

    class LLM:
        def __init__(self, model, seed, max_model_len, gpu_memory_utilization, tensor_parallel_size, dtype):
            if cuda.calls:
                raise RuntimeError(f"Cannot re-initialize CUDA in forked subprocess: the stage asked torch.cuda."
                                   f"{cuda.calls[0]}() before the engine started")
            assert os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn"
            assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"} & set(os.environ), "a world of one process"
            assert 0 < gpu_memory_utilization < 1 and tensor_parallel_size == 1 and max_model_len > 0
            assert dtype == "bfloat16"  # a GPU's: the stand-in's platform is not a CPU
            self.tok, self.model = models.load_tokenizer(model), AutoModelForCausalLM.from_pretrained(model).eval()
            engines.append(self)

        def generate(self, prompts, params, use_tqdm=True):
            outs = []
            for prompt, p in zip(prompts, params, strict=True):
                ids = prompt["prompt_token_ids"]
                assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
                torch.manual_seed(p.seed)
                with torch.no_grad():
                    new = self.model.generate(torch.tensor([ids]), do_sample=True, temperature=max(p.temperature, 1e-3),
                                              top_p=p.top_p, max_new_tokens=p.max_tokens,
                                              pad_token_id=self.tok.pad_token_id)[0, len(ids):].tolist()
                ended = self.tok.eos_token_id in new
                new = new[:new.index(self.tok.eos_token_id)] if ended else new
                out = types.SimpleNamespace(text=self.tok.decode(new, skip_special_tokens=True),
                                            finish_reason="stop" if ended else "length")
                outs.append(types.SimpleNamespace(outputs=[out]))
            return outs

    platforms = types.SimpleNamespace(current_platform=types.SimpleNamespace(is_cpu=lambda: False))
    return types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams, platforms=platforms)


@pytest.fixture
def vllm(monkeypatch):
    cuda, engines = CudaQueries(monkeypatch), []
    monkeypatch.setitem(sys.modules, "vllm", standin_vllm(cuda, engines))
    monkeypatch.setitem(sys.modules, "vllm.platforms", sys.modules["vllm"].platforms)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    return cuda, engines


def test_labelling_starts_vllm_before_any_cuda_query(vllm, tiny_model, tmp_path):
    cuda, engines = vllm
    write_graded(models.load_tokenizer(tiny_model), tmp_path / "g.jsonl", n_tasks=2)
    critic = tmp_path / "critic"  # a critic that is still pi_ref: what matters here is the order of the start
    shutil.copytree(tiny_model, critic)
    (critic / "run_settings.json").write_text(json.dumps({"model": tiny_model, "beta": 0.1}))
    label_turns.main(label_turns.Args(trajectories=str(tmp_path / "g.jsonl"), critic=str(critic),
                                      output=str(tmp_path / "pairs.jsonl"), agent_backend="vllm",
                                      gpu_memory_utilization=0.5, num_candidates=3, max_new_tokens=6))
    assert len(engines) == 1 and cuda.calls  # the engine started, and the scoring models asked about CUDA after it
    states = [json.loads(line) for line in open(f"{tmp_path / 'pairs.jsonl'}.states.jsonl")]
    assert len(states) == 6 and all(len(s["candidates"]) == 3 for s in states)  # 4 + 2 agent turns, 3 candidates each


def test_rollouts_start_vllm_before_any_cuda_query(vllm, tiny_model, task_files, simulator_url, tmp_path):
    cuda, engines = vllm
    rollout.main(rollout.Args(tasks=str(task_files[1]), num_tasks=2, agent_backend="vllm", agent_model=tiny_model,
                              simulator_url=simulator_url, max_turns=2, max_new_tokens=6, gpu_memory_utilization=0.5,
                              output=str(tmp_path / "traj.jsonl")))
    rows = [json.loads(line) for line in open(tmp_path / "traj.jsonl")]
    assert len(engines) == 1 and len(rows) == 2 and all(r["dialogue_history"][1]["role"] == "assistant" for r in rows)


def test_a_flash_attention_wheel_that_does_not_load_falls_back_to_sdpa(tmp_path, monkeypatch, capsys):
    """A flash-attn built for another torch is found but fails at import: the model is built with SDPA instead."""
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text(
        "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert models.attention(torch.device("cuda", 0)) == "sdpa"
    assert "does not load (ImportError: flash_attn_2_cuda.so: undefined symbol" in capsys.readouterr().err
    (tmp_path / "flash_attn" / "__init__.py").write_text("")  # one that loads
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert models.attention(torch.device("cuda", 0)) == "flash_attention_2"
    assert models.attention(torch.device("cpu")) == "sdpa"
