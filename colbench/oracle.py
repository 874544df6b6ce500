"""The oracle: a scripted ColBench agent that reads the hidden information. It asks for each hidden fact, then
answers with the ground truth: it proves the tasks solvable, and with hasty plans and turn mistakes it writes the
embedded model's warm-up dialogues (rollout.py --agent_backend oracle; docs/curriculum.md).

    agent = OracleAgent(tokenizer, args)   # args: seed, max_turns, oracle_hasty, oracle_mistake
    agent.generate(prompts, episodes)      # one turn for each dialogue: {"task", "sample", "task_type", "dialogue"}
"""
from __future__ import annotations

import random
import re

import colbench


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

    def __init__(self, tok, args):
        self.args, self.tok = args, tok

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
