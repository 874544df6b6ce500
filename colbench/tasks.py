"""ColBench's procedural tasks (ours; docs/curriculum.md): six families of small personalised functions, each
with two hidden facts in plain sentences, and Tailwind pages with five design facts, two of them hidden. Every
procedural ground truth runs in the sandboxed grader; a task whose ground truth errors or returns None on a test
is dropped.

    from colbench import tasks
    tasks.procedural("code", 100, seed=1, split="test")     # a list of tasks in the public format
"""
from __future__ import annotations

import random
import sys
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

import colbench
from colbench import sandbox

# ----------------------------------------------------------------------------------------------
# Procedural families. Each returns (description, facts, ground truth, test argument lists): two hidden
# facts, each with its own constant, so that an answer that misses or breaks either fails the tests.
# ----------------------------------------------------------------------------------------------
LABEL_PAIRS = [("pass", "fail"), ("approved", "rejected"), ("high", "low"), ("gold", "silver"), ("yes", "no"),
               ("ok", "alert"), ("big", "small"), ("hot", "cold"), ("premium", "basic"), ("green", "red"),
               ("accepted", "declined"), ("senior", "junior")]
THRESHOLD_CONTEXTS = [  # (function, argument, what it judges, noun for the argument)
    ("grade_exam", "score", "whether a student passed an exam from their score", "score"),
    ("classify_order", "total", "how to label a customer order from its total", "order total"),
    ("rate_temperature", "degrees", "how to label a temperature reading", "temperature"),
    ("check_loan", "credit_score", "whether a loan application goes through from the credit score", "credit score"),
    ("tag_player", "points", "how to tag a player from their points", "points total"),
    ("label_speed", "speed", "how to label a car's speed", "speed"),
    ("rank_employee", "years", "how to label an employee from their years of service", "number of years"),
    ("judge_battery", "percent", "how to label a phone's battery level", "battery percent"),
]


def fam_threshold(rng):
    fn, arg, what, noun = rng.choice(THRESHOLD_CONTEXTS)
    hi, lo = rng.choice(LABEL_PAIRS)
    t = rng.randint(11, 95)
    facts = [f"A {noun} of {t} or more gets the label '{hi}'.", f"Any lower {noun} gets the label '{lo}'."]
    gt = f"def {fn}({arg}):\n    if {arg} >= {t}:\n        return '{hi}'\n    return '{lo}'\n"
    xs = {t, t - 1, t + 1, t - rng.randint(2, 10), t + rng.randint(2, 10), 0, 100, t + 20}
    while len(xs) < 10:
        xs.add(rng.randint(0, 120))
    desc = f"I need a small function that decides {what}. It should return a label."
    return fn, f"{fn}({arg})", desc, facts, gt, [[x] for x in sorted(xs)]


FEE_CONTEXTS = [
    ("ticket_cost", "tickets", "the cost of buying concert tickets", "ticket"),
    ("delivery_price", "boxes", "the price of delivering some boxes", "box"),
    ("rental_charge", "days", "what to charge for renting a bike", "day"),
    ("class_fee", "lessons", "the fee for a number of swimming lessons", "lesson"),
    ("parking_cost", "hours", "the cost of parking a car", "hour"),
    ("print_price", "pages", "the price of printing pages", "page"),
]


def fam_fee(rng):
    fn, arg, what, unit = rng.choice(FEE_CONTEXTS)
    base, per = rng.sample(range(2, 31), 2)
    facts = [f"There is a fixed fee of {base} dollars.", f"Each {unit} costs {per} dollars on top of that."]
    gt = f"def {fn}({arg}):\n    return {base} + {per} * {arg}\n"
    xs = [0, 1, 2, 3, 5, 7, 10, 12, 20, rng.randint(21, 99)]
    desc = f"Can you write a function that works out {what}? It takes the number of {unit}s."
    return fn, f"{fn}({arg})", desc, facts, gt, [[x] for x in xs]


GREET_CONTEXTS = [("greet", "name", "a greeting for a guest"),
                  ("welcome_message", "user", "a welcome message for a new user"),
                  ("farewell", "name", "a goodbye message for a customer"),
                  ("shout_out", "player", "a shout-out for a player")]
WORDS = ["Hello", "Hi", "Howdy", "Welcome", "Greetings", "Hey", "Bye", "Cheers", "Good day", "Yo", "Ahoy", "Salut"]
ENDINGS = ["!", "!!", ".", "?", " :)", "!!!", "...", " <3"]


def fam_greeting(rng):
    fn, arg, what = rng.choice(GREET_CONTEXTS)
    word, end = rng.choice(WORDS), rng.choice(ENDINGS)
    facts = [f"The message starts with '{word}' and a space, then the {arg}.",
             f"The message ends with '{end}' right after the {arg}."]
    gt = f"def {fn}({arg}):\n    return '{word} ' + {arg} + '{end}'\n"
    names = rng.sample(["Ann", "Bob", "Carla", "Dev", "Eve", "Femi", "Gus", "Hana", "Ivan", "Jo", "Kim", "Lee"], 10)
    desc = f"Please write a function that builds {what} as a string."
    return fn, f"{fn}({arg})", desc, facts, gt, [[repr(n)] for n in names]


CONVERT_CONTEXTS = [
    ("crates_to_bottles", "crates", "crate", "bottles"), ("boxes_to_pencils", "boxes", "box", "pencils"),
    ("packs_to_cards", "packs", "pack", "cards"), ("trays_to_eggs", "trays", "tray", "eggs"),
    ("shelves_to_books", "shelves", "shelf", "books"), ("bags_to_apples", "bags", "bag", "apples"),
]


def fam_convert(rng):
    fn, arg, one, many = rng.choice(CONVERT_CONTEXTS)
    k = rng.choice([3, 5, 7, 8, 9, 11, 13, 14, 15, 16, 18, 24, 30, 36])
    extra = rng.choice([n for n in range(2, 40) if n != k])
    facts = [f"One {one} holds {k} {many}.", f"Add {extra} spare {many} to every count."]
    gt = f"def {fn}({arg}):\n    return {arg} * {k} + {extra}\n"
    xs = [0, 1, 2, 3, 4, 5, 10, 12, 25, rng.randint(26, 99)]
    desc = f"I want a function that turns a number of {arg} into the number of {many} in our store."
    return fn, f"{fn}({arg})", desc, facts, gt, [[x] for x in xs]


AGG_CONTEXTS = [("sum_big_sales", "sales", "sales amounts"), ("total_long_calls", "minutes", "call lengths in minutes"),
                ("count_heavy_parcels", "weights", "parcel weights"), ("sum_high_scores", "scores", "game scores")]


def fam_aggregate(rng):
    fn, arg, what = rng.choice(AGG_CONTEXTS)
    t = rng.randint(11, 60)
    times = rng.choice([2, 3, 4, 6, 10])
    facts = [f"Only {what} greater than {t} are used.", f"The result is multiplied by {times}."]
    op = "len" if fn.startswith("count") else "sum"
    gt = f"def {fn}({arg}):\n    return {times} * {op}([x for x in {arg} if x > {t}])\n"
    lists = [[rng.randint(0, 2 * t + 10) for _ in range(rng.randint(1, 6))] for _ in range(9)] + [[t, t + 1, t - 1]]
    desc = (f"Write a function that looks at a list of {what} and gives me one number from it "
            f"({'how many' if op == 'len' else 'their total'}).")
    return fn, f"{fn}({arg})", desc, facts, gt, [[repr(x)] for x in lists]


SCORE_CONTEXTS = [("league_points", "wins", "draws", "league points for a team"),
                  ("reward_points", "purchases", "reviews", "loyalty points for a shopper"),
                  ("quiz_score", "correct", "bonus", "the final quiz score"),
                  ("xp_total", "quests", "kills", "experience points in a game")]


def fam_score(rng):
    fn, a, b, what = rng.choice(SCORE_CONTEXTS)
    wa, wb = rng.sample([2, 4, 5, 6, 7, 9, 10, 12, 15], 2)
    facts = [f"Each one of the {a} is worth {wa} points.", f"Each one of the {b} is worth {wb} points."]
    gt = f"def {fn}({a}, {b}):\n    return {a} * {wa} + {b} * {wb}\n"
    pairs = [[0, 0], [1, 0], [0, 1], [2, 3], [5, 1], [3, 4], [10, 2], [7, 7], rng.sample(range(20), 2), [4, 9]]
    desc = f"I need a function that computes {what}."
    return fn, f"{fn}({a}, {b})", desc, facts, gt, pairs


FAMILIES = {"threshold": fam_threshold, "fee": fam_fee, "greeting": fam_greeting, "convert": fam_convert,
            "aggregate": fam_aggregate, "score": fam_score}


def procedural_task(rng, family=None):
    """One task from a random family, in the public format (plus `family`)."""
    family = family or rng.choice(sorted(FAMILIES))
    fn, sig, desc, facts, gt, arg_lists = FAMILIES[family](rng)
    calls = [f"{fn}({', '.join(str(a) for a in args)})" for args in arg_lists]
    return {"problem_description": f"{desc} The signature of the function is: def {sig}",
            "hidden_information": "\n".join(facts), "ground_truth": gt,
            "test_cases": {f"test{i + 1}": c for i, c in enumerate(calls)}, "family": family}


# ----------------------------------------------------------------------------------------------
# Procedural frontend pages (Tailwind 2.2.19) with hidden design facts: a header with the business's
# name, a row of boxes and a footer, set by five facts (colbench.DESIGN_FACTS: page background,
# header colour, number of boxes, footer colour, title alignment). The description states three of
# them, the background always (two values: a guess would be right half the time); two are hidden, one a
# line of hidden_information, for the agent to ask about or find by showing drafts, as a code task's two
# facts (docs/frontend.md). A page is ~150 tokens, short enough for the 135M agent to write.
# ----------------------------------------------------------------------------------------------
BUSINESSES = ["bakery", "law firm", "yoga studio", "bike shop", "dental clinic", "coffee roaster", "museum",
              "travel agency", "bookstore", "flower shop", "gym", "animal shelter", "hotel", "pizzeria"]
STATED, HIDDEN = ("background",), 2  # facts every description states; how many of the others are hidden
TAILWIND_LINK = '<link href="https://cdn.jsdelivr.net/npm/tailwindcss@2.2.19/dist/tailwind.min.css" rel="stylesheet">'


def procedural_page(rng):
    """One frontend task: problem_description (with the stated facts), hidden_information (the hidden
    facts, one a line, most important first) and ground_truth (the target HTML)."""
    design = {k: rng.choice(values) for k, (_, values) in colbench.DESIGN_FACTS.items()}
    hidden = set(rng.sample(sorted(k for k in design if k not in STATED), HIDDEN))
    stated = " ".join(colbench.design_fact(k, design[k]) for k in design if k not in hidden)
    biz = rng.choice(BUSINESSES)
    mood = rng.choice(['clean', 'bold', 'friendly', 'simple'])
    return {"problem_description": f"I want a {mood} web page for my {biz}: "
                                   f"a header with its name, a row of boxes and a footer. {stated}",
            "hidden_information": "\n".join(colbench.design_fact(k, design[k]) for k in design if k in hidden),
            "ground_truth": f"<html>\n{TAILWIND_LINK}\n{colbench.design_page(design, biz.title())}\n</html>"}


# ----------------------------------------------------------------------------------------------
def ground_truth_runs(task):
    """True when the ground truth returns a non-None value on every test (sandboxed)."""
    res = sandbox.run_calls(task["ground_truth"], list(task["test_cases"].items()))
    return all(kind == "ok" and value is not None for kind, value in res.values())


def keep_runnable(tasks, workers):
    with ThreadPoolExecutor(workers) as pool:
        ok = list(tqdm(pool.map(ground_truth_runs, tasks), total=len(tasks), desc="checking ground truths"))
    dropped = len(tasks) - sum(ok)
    if dropped:
        print(f"dropped {dropped} task(s) whose ground truth fails on its tests", file=sys.stderr)
    return [t for t, k in zip(tasks, ok) if k]


def procedural(task_type, num_tasks, seed=0, split="all", exclude=(), workers=8):
    """num_tasks new tasks of --split (test: a fifth of the identities, train: the rest), none in `exclude` (a set
    of colbench.task_identity); code tasks whose ground truth fails its tests are dropped."""
    make = procedural_page if task_type == "html" else procedural_task
    rng, tasks, seen = random.Random(seed), [], set(exclude)
    for _ in range(num_tasks * 250):  # a fifth of the draws are test tasks
        if len(tasks) == num_tasks:
            break
        t = make(rng)
        t["task_id"] = colbench.task_id(t)
        if colbench.task_identity(t) not in seen and split in ("all", colbench.task_split(t)):
            seen.add(colbench.task_identity(t))
            tasks.append(t)
    return keep_runnable(tasks, workers) if task_type == "code" else tasks
