"""The scripted human of the embedded setting (deterministic, instant on a CPU): it reads the hidden information
out of the human prompt (colbench.HUMAN_PROMPT, or a released-format template) and answers the agent's last message
with at most two hidden lines that share the most words with it (colbench.scripted_reply), or says it doesn't know.
On procedural pages it quotes the most important hidden design fact a shown draft gets wrong, read from the draft's
pixels (colbench.draft_reply). simulator.py serves it over HTTP as the stages see an LLM human. human_requests builds
the human's chat for many dialogues at once (pages: rendered for it).

    ScriptedHuman().chat(colbench.human_messages(task, dialogue))
"""
from __future__ import annotations

import re

import colbench
from colbench import render


class ScriptedHuman:
    """The scripted human: chat(messages) -> its reply, messages as colbench.human_messages builds them."""
    name = "scripted-human"

    @staticmethod
    def count(text):
        return len(re.findall(r"\w+|[^\w\s]", text))

    def __init__(self, human_template=None):
        self.human_template = human_template  # --prompt_dir: the hidden information is inside this template

    def chat(self, messages):
        system = next((m["content"] for m in messages if m["role"] == "system"), "")
        last = messages[-1]["content"] if messages else ""
        hidden = colbench.parse_hidden_information(system)
        if isinstance(last, list):  # multimodal content: a design question, with its images
            images = [render.data_url_to_image(p["image_url"]["url"]) for p in last
                      if isinstance(p, dict) and p.get("type") == "image_url"]
            texts = [p.get("text", "") for p in last if isinstance(p, dict) and p.get("type") == "text"]
            if hidden is not None:  # a page with hidden design facts (ours): a draft gets one fact, a question lines
                if len(images) > 1:  # the hidden facts, then those of its request (in the system prompt)
                    request = system.split("HIDDEN INFORMATION", 1)[0]
                    return colbench.draft_reply(hidden, render.design_features(images[0]), colbench.design_in(request))
                return colbench.scripted_reply(hidden, texts[0] if texts else "")
            if images:
                raise ValueError("the scripted human answers procedural pages (hidden design facts) only: for "
                                 "ColBench's own pages, serve a vision-language model and pass its URL")
            last = " ".join(texts)
        parsed = self.human_template and colbench.parse_templated(self.human_template, last)
        if parsed:  # the released format: the template, with the whole transcript, in one user message
            hidden, last = parsed
        if hidden is not None:
            return colbench.scripted_reply(hidden, last)
        return "I don't know, sorry."


def human_requests(episodes, task_type="code", prompts=None, pool=None, targets=None):
    """The human's chat for each dialogue whose agent just spoke (episodes: {"task", "dialogue"}). Pages (a
    render.RenderPool): the human also sees the target page rendered (once a task, kept in `targets`) and the agent's
    snippet rendered, if its turn shows one."""
    if pool is None:
        return [colbench.human_messages(ep["task"], ep["dialogue"], task_type, prompts=prompts) for ep in episodes]
    new = {ep["task"]["task_id"]: ep["task"]["ground_truth"] for ep in episodes if ep["task"]["task_id"] not in targets}
    targets.update(zip(new, (img for img, _ in pool.render_many(list(new.values()), kept=True))))
    snippets = [render.extract_html(ep["dialogue"][-1]["content"]) for ep in episodes]
    renders = pool.render_many([s for s in snippets if s])
    agent_imgs = [renders.pop(0)[0] if s else None for s in snippets]
    return [colbench.human_messages(ep["task"], ep["dialogue"], "html", img, targets[ep["task"]["task_id"]], prompts)
            for ep, img in zip(episodes, agent_imgs)]
