"""ColBench, the benchmark, usable without the training loop (README, "ColBench as a package"). This module holds its
rules: the task format (load_tasks), the agent's and the human's prompts (agent_messages, human_messages), the scripted
human's reply rules, the ground-truth class of a candidate turn, and the graded-trajectory format with the critic's
trajectory pairs. Beside it: tasks.py (procedural tasks), human.py (the scripted human), oracle.py (a scripted agent
that reads the hidden information), sandbox.py (the sandboxed unit-test grader), render.py (pages and similarity),
grade.py (grading many dialogues; the benchmark's tables). None of it is learning code.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

from common import DataError, read_jsonl
from colbench.render import extract_html, image_to_data_url  # frontend helpers used by the prompts

ANSWER_MARKER = "I WANT TO ANSWER:"
HUMAN_MAX_CHARS = {"code": 400, "html": 1000}  # the paper's ColBench rules: the human's reply is cut to this length


# ----------------------------------------------------------------------------------------------
# Tasks (the public ColBench formats, unchanged)
# ----------------------------------------------------------------------------------------------
TASK_FIELDS = {
    "code": {"problem_description": str, "hidden_information": str, "ground_truth": str, "test_cases": dict},
    "html": {"problem_description": str, "ground_truth": str},
}


def task_identity(task):
    """What makes two tasks the same task, wherever tasks are kept apart (test, train, warm-up, validation): the
    same description and the same hidden information (a page without any: its target page), whatever their tests.
    A digest."""
    hidden = task.get("hidden_information") or task.get("ground_truth")
    blob = json.dumps([task.get("problem_description"), hidden], ensure_ascii=False)
    return hashlib.sha1(blob.encode()).hexdigest()


def task_split(task):
    """'test' for a fifth of all procedural tasks (by task_identity), 'train' for the rest: a task that one draw
    tests on is never a task another draw trains, warms up or validates on, whatever the seeds."""
    return "test" if int(task_identity(task), 16) % 5 == 0 else "train"


def task_id(task):
    """The task's own id if it has one, else a stable id derived from its content."""
    if task.get("task_id"):
        return str(task["task_id"])
    # all the task's content: two tasks that differ only in their tests must not share an id
    fields = ("problem_description", "hidden_information", "ground_truth", "test_cases")
    blob = json.dumps([task.get(k) for k in fields], ensure_ascii=False, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def validate_task(task, task_type="code", where="task"):
    """Raise DataError naming `where` (file:line) if a required field is missing or mistyped."""
    for field, kind in TASK_FIELDS[task_type].items():
        if field not in task:
            raise DataError(f"{where}: missing field '{field}' (a {task_type} task needs "
                            f"{', '.join(TASK_FIELDS[task_type])})")
        if not isinstance(task[field], kind):
            raise DataError(f"{where}: field '{field}' must be {kind.__name__}, got {type(task[field]).__name__}")
    if task_type == "code":
        if not task["test_cases"]:
            raise DataError(f"{where}: 'test_cases' is empty")
        for name, call in task["test_cases"].items():
            if not isinstance(call, str) or not call.strip():
                raise DataError(f"{where}: test case '{name}' must be a non-empty call expression")


def load_tasks(path, task_type="code"):
    """Tasks from a JSONL file or a `datasets` dataset saved on disk (html: also WebSight-style rows, `text` the
    HTML and `llm_generated_idea` the request); each gets a `task_id`."""
    path = Path(path)
    if path.is_dir():  # datasets.save_to_disk output
        import datasets
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[next(iter(ds))]
        rows = [(i + 1, dict(r)) for i, r in enumerate(ds)]
        if task_type == "code":  # datasets stores test_cases as a JSON string or a struct
            for _, r in rows:
                if isinstance(r.get("test_cases"), str):
                    r["test_cases"] = json.loads(r["test_cases"])
                if isinstance(r.get("test_cases"), dict):
                    r["test_cases"] = {k: v for k, v in r["test_cases"].items() if v is not None}
    else:
        rows = read_jsonl(path)
    tasks = []
    for line, t in rows:
        if task_type == "html" and "ground_truth" not in t and "text" in t:  # WebSight: text = HTML, idea = request
            t = {"problem_description": t.get("llm_generated_idea") or "A web page.", "ground_truth": t["text"]}
        validate_task(t, task_type, where=f"{path}:{line}")
        tasks.append(dict(t, task_id=task_id(t)))
    return tasks


# ----------------------------------------------------------------------------------------------
# Prompts (ours, following the paper's protocol)
# ----------------------------------------------------------------------------------------------
AGENT_SYSTEM_PROMPT = {
    "code": ("You help a human write one Python function. The human knows details you do not. "
             "Ask one short question per turn about what you need to know, for at most {max_turns} turns. "
             f"When you know enough, reply with {ANSWER_MARKER} followed only by the Python function."),
    "html": ("You help a human design one web page with HTML and Tailwind CSS. The human has a picture of the page "
             "they want in mind. In each turn you may include at most one HTML snippet (<html>...</html>); it is "
             "rendered and shown to the human, who tells you how it differs from what they want. Ask short "
             f"questions, for at most {{max_turns}} turns. When ready, reply with {ANSWER_MARKER} followed only by "
             "the full HTML."),
}

HUMAN_PROMPT = {
    "code": ("You are a person who asked an assistant to write a Python function.\n"
             "Your request: {problem_description}\n\n"
             "HIDDEN INFORMATION (only you know it):\n{hidden_information}\nEND HIDDEN INFORMATION\n\n"
             "Answer the assistant's last message using only the hidden information, in at most two "
             "sentences. If the hidden information does not cover the question, say you don't know. "
             "Never write code."),
    "html": ("You are a person who asked an assistant to design a web page: {problem_description}\n"
             "You will see up to two images: the assistant's page rendered (if it showed one) and the page you want. "
             "Describe the most outstanding concrete differences between them (background and text colours, layout, "
             "alignment, missing or extra sections, sizes) in at most three sentences. Never write code."),
    # ours: procedural pages with hidden design facts (the human also holds them as text)
    "html_facts": ("You are a person who asked an assistant to design a web page: {problem_description}\n\n"
                   "HIDDEN INFORMATION (only you know it):\n{hidden_information}\nEND HIDDEN INFORMATION\n\n"
                   "If the assistant shows you its page (the first image), name the single most important hidden fact "
                   "it gets wrong, or if none, the first fact of your request it gets wrong. Otherwise answer its last "
                   "message using only the hidden information, in at most two sentences, or say you don't know. Never "
                   "reveal more than asked. Never write code."),
}


# --prompt_dir DIR: templates that replace ours, in the released message format. A folder of ours
# (agent_code.txt, human_code.txt, agent_html.txt, human_html.txt) or a released checkout's prompts/.
PROMPT_FILES = {"agent": ("agent_{}.txt", "llm_agent_{}_prompt.txt"),
                "human": ("human_{}.txt", "human_simulator_{}_prompt.txt")}
HUMAN_FIELDS = ("problem_description", "hidden_information", "dialogue_history")


def load_prompts(prompt_dir, task_type="code"):
    """{"agent": text, "human": text} for task_type from prompt_dir, or None without one (our prompts).
    A code human template must hold {hidden_information}, and may use only the HUMAN_FIELDS."""
    if not prompt_dir:
        return None
    if not Path(prompt_dir).is_dir():
        raise DataError(f"--prompt_dir {prompt_dir}: not a directory")
    out = {}
    for role, names in PROMPT_FILES.items():
        paths = [Path(prompt_dir) / n.format(task_type) for n in names]
        path = next((p for p in paths if p.exists()), None)
        if path is None:
            raise DataError(f"--prompt_dir {prompt_dir}: no {role} template for {task_type} tasks "
                            f"(expected {' or '.join(p.name for p in paths)})")
        out[role] = path.read_text()
    if task_type == "code":
        try:
            out["human"].format(**{f: "" for f in HUMAN_FIELDS})
        except (KeyError, IndexError, ValueError) as e:
            fields = ", ".join("{%s}" % f for f in HUMAN_FIELDS)
            raise DataError(f"{path}: a human template may use only {fields} (write {{{{ and }}}} for "
                            f"literal braces), not {e}") from None
        if "{hidden_information}" not in out["human"]:
            raise DataError(f"{path}: the human template must contain {{hidden_information}}")
    return out


def transcript(dialogue):
    """The released human's view of the dialogue: one string, each message as `role:content`."""
    return "".join(f"{m['role']}:{m['content']}\n\n\n\n" for m in dialogue) + "agent:"


def parse_templated(template, text):
    """Inverse of a --prompt_dir human template (for the scripted human): (hidden information, the
    agent's last message), or None when text was not made from template."""
    pattern, seen = "", set()
    for part in re.split(r"(\{(?:problem_description|hidden_information|dialogue_history)\})", template):
        name = part[1:-1] if part[1:-1] in HUMAN_FIELDS else None
        if name is None:
            pattern += re.escape(part.replace("{{", "{").replace("}}", "}"))
        elif name in seen or name == "problem_description":
            pattern += ".*?"
        else:
            seen.add(name)
            pattern += f"(?P<{name}>.*?)" if name == "hidden_information" else f"(?P<{name}>.*)"
    m = re.fullmatch(pattern, text, re.S)
    if m is None:
        return None
    history = (m.groupdict().get("dialogue_history") or "").strip().removesuffix("agent:")
    return m["hidden_information"], history[history.rfind("assistant:") + len("assistant:"):].strip()


def human_messages(task, dialogue, task_type="code", agent_image=None, target_image=None, prompts=None):
    """The simulated human's chat request: our prompt as system, then the dialogue with roles
    swapped (the agent speaks as `user` to the human model). For html, the agent's last message
    also carries the two images as data URLs (its render, or a note that there is none; the target).
    With --prompt_dir templates (prompts), the released format: code gets a generic system line and
    one user message, the template filled with the task and the whole transcript; html gets one
    user message, the template's text and then the two images."""
    if prompts and task_type == "code":
        text = prompts["human"].format(problem_description=task["problem_description"],
                                       hidden_information=task["hidden_information"],
                                       dialogue_history=transcript(dialogue))
        return [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": text}]
    facts = task_type == "html" and task.get("hidden_information")  # a procedural page with hidden design facts
    system = prompts["human"] if prompts else HUMAN_PROMPT["html_facts" if facts else task_type].format(**task)
    if task_type == "html":
        content = [{"type": "text", "text": dialogue[-1]["content"][-2000:]}]
        if agent_image is not None:
            content += [{"type": "text", "text": "The assistant's page:"},
                        {"type": "image_url", "image_url": {"url": image_to_data_url(agent_image)}}]
        else:
            content += [{"type": "text", "text": "The assistant has not shown a page in this message."}]
        content += [{"type": "text", "text": "The page you want:"},
                    {"type": "image_url", "image_url": {"url": image_to_data_url(target_image)}}]
        if prompts:
            return [{"role": "user", "content": [{"type": "text", "text": system}] + content[1:]}]
        return [{"role": "system", "content": system}, {"role": "user", "content": content}]
    msgs = [{"role": "system", "content": system}]
    for m in dialogue[1:]:  # dialogue[0] is the human's own request
        msgs.append({"role": "user" if m["role"] == "assistant" else "assistant", "content": m["content"]})
    return msgs


# ----------------------------------------------------------------------------------------------
# The scripted human (simulator.py's default backend) and the ground-truth credit of a turn
# ----------------------------------------------------------------------------------------------
STOPWORDS = set("""a an the is are was were be been to of in on for and or but with at by from as it its this that
these those what which who whom whose how when where why do does did can could would should will shall may might must
i you he she we they me my your our their us them please tell know need want like about any some there here if then
so just also more most very much many than too not no yes okay ok thanks thank function python code write give
let have has had get make use value values one""".split())


def words(text):
    """Lower-case content words; identifiers split at '_'; a plural 's' dropped."""
    out = set()
    for w in re.findall(r"[A-Za-z]+|\d+", text.replace("_", " ")):
        w = w.lower()
        if w in STOPWORDS or len(w) < 2 and not w.isdigit():
            continue
        out.add(w[:-1] if len(w) > 3 and w.endswith("s") else w)
    return out


def scripted_reply(hidden, question, max_lines=1):
    """The hidden line the question asks about, else "I don't know": one fact a reply, so every fact costs the
    agent a turn. A line is ranked by the question's words it alone holds among the hidden lines, then by all
    the words they share, then by its place."""
    lines = [l.strip() for l in hidden.splitlines() if l.strip()]
    q, ws = words(question), [words(l) for l in lines]
    scored = []
    for i, (line, w) in enumerate(zip(lines, ws)):
        own = w - set().union(*(o for j, o in enumerate(ws) if j != i))
        if q & w:
            scored.append((-len(q & own), -len(q & w), i, line))
    if not scored:
        return "I don't know, sorry."
    best = sorted(sorted(scored)[:max_lines], key=lambda s: s[2])  # the best lines, in original order
    is_code = hidden.lstrip().startswith(("def ", "import ", "from ", "class "))
    return ("\n" if is_code else " ").join(line for *_, line in best)


def hidden_facts(task):
    """The task's hidden facts: its non-empty hidden-information lines, stripped. Procedural tasks state
    each fact on one line, and the scripted human quotes lines."""
    return [line.strip() for line in task["hidden_information"].splitlines() if line.strip()]


def revealed_facts(task, dialogue):
    """Hidden facts the human has already said in `dialogue` (its user messages after the request)."""
    said = " ".join(m["content"] for m in dialogue[1:] if m["role"] == "user")
    return {f for f in hidden_facts(task) if f in said}


def knows_every_fact(task, dialogue):
    """Whether the human has said every hidden fact in `dialogue` (an informed state)."""
    return len(revealed_facts(task, dialogue)) == len(hidden_facts(task))


OUTCOMES = ("informed_pass", "informed_fail", "hasty_pass", "hasty_fail", "no_answer")


def dialogue_outcome(row):
    """Where a graded procedural code dialogue ended (one of OUTCOMES): answered after the human had said
    every hidden fact (informed) or before (hasty), passing all tests or not; or never answered."""
    d = row["dialogue_history"]
    agent = [j for j, m in enumerate(d) if m["role"] == "assistant"]
    if not agent or row.get("finish", "answered") != "answered":
        return "no_answer"
    informed = "informed" if knows_every_fact(row["task"], d[:agent[-1]]) else "hasty"
    return f"{informed}_{'pass' if row.get('success') else 'fail'}"


# ----------------------------------------------------------------------------------------------
# Procedural frontend pages with hidden design facts (ours; generate_tasks.py). Each fact is one
# sentence; the description states some, hidden_information the others, one a line. The scripted
# human answers a text question with the hidden lines it matches (as on code) and a shown draft with
# the most important hidden fact it gets wrong (else the first fact of its request it breaks), read
# from the draft's pixels (render.design_features).
# ----------------------------------------------------------------------------------------------
HUES = ("red", "yellow", "green", "blue", "purple", "pink", "gray")
DESIGN_FACTS = {  # key -> (sentence, values), in the order the human ranks a draft's differences
    "background": ("The page background is {}.", ("white", "dark")),
    "header": ("The header is {}.", HUES),
    "boxes": ("There are {} boxes in a row.", ("2", "3", "4")),
    "footer": ("The footer is {}.", HUES),
    "title": ("The title is aligned to the {}.", ("left", "center", "right")),
}
def design_page(design, title):
    """The page (a <body> element) of a design {key: value} (colbench.DESIGN_FACTS); the boxes take the header's hue."""
    dark = design["background"] == "dark"
    box = f'<div class="bg-{design["header"]}-200"></div>'
    return (f'<body class="{"bg-gray-900" if dark else "bg-white"}">\n'
            f'<header class="bg-{design["header"]}-600 text-white text-4xl text-{design["title"]} p-6">'
            f'{title}</header>\n'
            f'<div class="grid grid-cols-{design["boxes"]} gap-4 p-6 h-36">{box * int(design["boxes"])}</div>\n'
            f'<footer class="bg-{design["footer"]}-700 text-white p-4">{title}</footer>\n</body>')


def design_fact(key, value):
    return DESIGN_FACTS[key][0].format(value)


def parse_design_fact(line):
    """(key, value) of a design-fact sentence, or None."""
    for key, (sentence, values) in DESIGN_FACTS.items():
        m = re.fullmatch(re.escape(sentence).replace(r"\{\}", "(\\w+)"), line.strip())
        if m and m.group(1) in values:
            return key, m.group(1)
    return None


def design_in(text):
    """{key: value} of the design-fact sentences in `text` (a request, hidden lines, what the human said)."""
    return dict(filter(None, map(parse_design_fact, re.split(r"(?<=\.)\s+|\n", text))))


def design_of(task):
    """{key: value} of every design fact a procedural page states (description and hidden lines);
    empty for other frontend tasks."""
    return design_in(task.get("problem_description", "") + "\n" + task.get("hidden_information", ""))


def design_mismatches(design, features):
    """The keys of `design` (in DESIGN_FACTS order) that a render's features (render.design_features) get wrong."""
    return [k for k in DESIGN_FACTS if k in design and features.get(k) != design[k]]


def draft_reply(hidden, features, stated=None):
    """The scripted human's reply to a shown draft: the most important hidden fact the draft gets wrong,
    quoted; never more than one. A draft right on every hidden fact that breaks a fact of the request
    (stated: {key: value}; a fact the hidden lines change is not the request's) hears the first such fact
    (nothing new) instead of an approval."""
    hidden_design = design_in(hidden)
    for design in (hidden_design, {k: v for k, v in (stated or {}).items() if k not in hidden_design}):
        wrong = design_mismatches(design, features)
        if wrong:
            return f"Not quite. {design_fact(wrong[0], design[wrong[0]])}"
    return "Yes, that is what I have in mind."


def turn_kind(turn):
    """What an agent turn does: 'answer' (it carries the answer marker), 'draft' (it shows a page) or
    'question'."""
    if ANSWER_MARKER in turn:
        return "answer"
    return "draft" if extract_html(turn) else "question"


def parse_hidden_information(system_prompt):
    """Inverse of HUMAN_PROMPT for the scripted simulator: the hidden lines, or None."""
    m = re.search(r"HIDDEN INFORMATION \(only you know it\):\n(.*?)\nEND HIDDEN INFORMATION", system_prompt, re.S)
    return m.group(1) if m else None


def agent_messages(task, dialogue, task_type="code", prompts=None, max_turns=10):
    """The agent's chat: our system prompt, which states the turn budget it really has (or the --prompt_dir agent
    template, verbatim, as released), then the dialogue as the agent saw it."""
    system = prompts["agent"] if prompts else AGENT_SYSTEM_PROMPT[task_type].format(max_turns=max_turns)
    return [{"role": "system", "content": system}] + \
           [{"role": m["role"], "content": m["content"]} for m in dialogue]


def split_output(output):
    """Released: an agent turn shows the human only what follows its first `OUTPUT:` (any thinking
    before it is dropped), and the stored output keeps at most one `OUTPUT:` section.
    Returns (content, stored output)."""
    if "OUTPUT:" not in output:
        return output, output
    parts = output.split("OUTPUT:")
    return parts[1], "OUTPUT:".join(parts[:2])


def final_answer(dialogue, task_type="code"):
    """The dialogue's answer, as released: code, the last agent turn's (after the marker); html, the
    page of the last agent turn that showed one, whichever turn that was (empty when none did)."""
    turns = [m["content"] for m in dialogue if m["role"] == "assistant"]
    if task_type == "html":
        return next((h for h in (extract_answer(t, "html") for t in reversed(turns)) if h), "")
    return extract_answer(turns[-1]) if turns else ""


def extract_answer(text, task_type="code"):
    """The final answer of an agent turn: what follows the marker (or the whole turn); for html,
    the HTML extracted from it as released (empty when there is none)."""
    if ANSWER_MARKER in text:
        text = text.split(ANSWER_MARKER, 1)[1]
    if task_type == "html":
        return extract_html(text) or ""
    return text.strip()


# ----------------------------------------------------------------------------------------------
# Graded trajectories and the critic's trajectory pairs
# ----------------------------------------------------------------------------------------------
def agent_turns(traj):
    """[(input, output)] of a trajectory's agent turns, in order."""
    return [(m["input"], m["output"]) for m in traj["dialogue_history"] if m["role"] == "assistant" and "input" in m]


def num_agent_turns(r):
    """How many agent turns a trajectory has (its stored num_turns, when it has one)."""
    return r.get("num_turns", sum(m["role"] == "assistant" for m in r["dialogue_history"]))


def trajectory_pairs(rows, task_type="code", min_gap=0.1):
    """(chosen, rejected) trajectory pairs from graded rollouts, as released. Per task the best sample must
    succeed; every lower-reward sample of that task is a rejected partner: code tasks, and (ours) procedural pages,
    whose success is every design fact right and whose reward the share of facts right. ColBench's own pages have
    no success: every two samples whose rewards (similarities) differ by at least min_gap."""
    by_task = {}
    for r in rows:
        by_task.setdefault(r["task_id"], []).append(r)
    pairs = []
    for group in by_task.values():
        group = sorted(group, key=lambda r: (-r["reward"], r.get("sample", 0)))
        if task_type == "code" or all("success" in r for r in group):
            best = group[0]
            if best.get("success", best["reward"] >= 1.0):
                pairs += [(best, r) for r in group[1:] if r["reward"] < best["reward"]]
        else:
            pairs += [(a, b) for i, a in enumerate(group) for b in group[i + 1:]
                      if a["reward"] - b["reward"] >= min_gap]
    return pairs


def validate_trajectory(r, where, task_type=None):
    """Raise DataError naming `where` (file:line) if a trajectory is malformed. The task is checked
    fully when task_type is given, else only for the ground truth the critic needs."""
    for field in ("task", "dialogue_history"):
        if field not in r:
            raise DataError(f"{where}: missing field '{field}' (a trajectory needs task, dialogue_history and answer)")
    if not isinstance(r["task"], dict):
        raise DataError(f"{where}: 'task' must be an object, got {type(r['task']).__name__}")
    if task_type:
        validate_task(r["task"], task_type, where)
    elif not isinstance(r["task"].get("ground_truth"), str):
        raise DataError(f"{where}: task.ground_truth must be a string (the critic's training-time information)")
    if not isinstance(r["dialogue_history"], list):
        raise DataError(f"{where}: 'dialogue_history' must be a list of messages")
    for j, m in enumerate(r["dialogue_history"]):
        if not (isinstance(m, dict) and m.get("role") in ("user", "assistant", "system")
                and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: dialogue_history[{j}] must be {{'role': user|assistant|system, 'content': str}}")
        if m["role"] == "assistant" and "input" in m and not (isinstance(m["input"], str)
                                                               and isinstance(m.get("output"), str)):
            raise DataError(f"{where}: dialogue_history[{j}]: stored 'input' and 'output' must both be strings")
    if not isinstance(r.get("answer", ""), (str, type(None))):
        raise DataError(f"{where}: 'answer' must be a string or null")


def load_graded(path, task_type=None):
    """Graded trajectories (evaluate.py output); each needs `reward` and stored agent inputs/outputs.
    Dialogues that ended in an infrastructure error (finish=error) are
    left out with a note: their low reward says nothing about the agent."""
    rows, errors = [], 0
    for line, r in read_jsonl(path):
        validate_trajectory(r, f"{path}:{line}", task_type)
        if "reward" not in r:
            raise DataError(f"{path}:{line}: missing 'reward' (grade rollouts with evaluate.py first)")
        if not isinstance(r["reward"], (int, float)) or isinstance(r["reward"], bool):
            raise DataError(f"{path}:{line}: 'reward' must be a number, got {r['reward']!r}")
        r["task_id"] = r.get("task_id") or task_id(r["task"])
        if not agent_turns(r):
            raise DataError(f"{path}:{line}: no assistant turn with stored 'input' and 'output'")
        if r.get("finish") == "error":
            errors += 1
            continue
        rows.append(r)
    if errors:
        print(f"{path}: left out {errors} dialogues that ended with finish=error", file=sys.stderr)
    if not rows:
        raise DataError(f"{path}: no usable trajectories")
    return rows
