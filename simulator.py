"""The embedded simulated human: an OpenAI-compatible server on localhost (GET /v1/models, POST
/v1/chat/completions), so rollout.py talks to it exactly as it would to `vllm serve
meta-llama/Llama-3.1-70B-Instruct`. Replies carry `usage` in words and punctuation marks.

    python simulator.py                          # scripted human on http://127.0.0.1:8000/v1
    python simulator.py --port 0                 # any free port; the URL is printed when ready

The scripted human (deterministic, instant on CPU) reads the hidden information out of the human
prompt (colbench.HUMAN_PROMPT, or with --prompt_dir the folder's code human template, in the
released format) and answers the agent's last message with at most two hidden lines that share the
most words with it, or says it doesn't know. On procedural pages (colbench.DESIGN_FACTS) it quotes
the most important hidden fact a shown draft gets wrong, read from the draft's pixels. Given images
only (ColBench's own frontend tasks), it compares the agent's render with the target's pixels and
names the most outstanding differences in at most three sentences.

Deviation from the paper: the scripted human replaces Llama-3.1-70B on CPU; it never paraphrases and
answers only when the question shares words with a hidden fact.
"""
from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import colbench
import common
import render


@dataclass
class Args:
    host: str = "127.0.0.1"
    """interface to listen on"""
    port: int = 8000
    """port (0 = pick a free one)"""
    prompt_dir: str = ""
    """the folder of prompt templates rollout.py uses (--prompt_dir), to find the hidden information"""


# ----------------------------------------------------------------------------------------------
# Design feedback (frontend): a deterministic critic comparing the agent's render with the target's
# pixels: colours of the page, header and footer, the stack of colour blocks, alignment, height.
# ----------------------------------------------------------------------------------------------
SHADES = {"red": [(254, 226, 226), (239, 68, 68), (153, 27, 27)], "yellow": [(254, 243, 199), (245, 158, 11), (146, 64, 14)],
          "green": [(209, 250, 229), (16, 185, 129), (6, 95, 70)], "blue": [(219, 234, 254), (59, 130, 246), (30, 64, 175)],
          "indigo": [(224, 231, 255), (99, 102, 241), (55, 48, 163)], "purple": [(237, 233, 254), (139, 92, 246), (91, 33, 182)],
          "pink": [(252, 231, 243), (236, 72, 153), (157, 23, 77)], "gray": [(243, 244, 246), (107, 114, 128), (31, 41, 55)]}
PALETTE = [("white", (255, 255, 255)), ("black", (0, 0, 0))] + \
    [(f"{pre}{hue}", rgb) for hue, rgbs in SHADES.items() for pre, rgb in zip(("light ", "", "dark "), rgbs)]


def colour_name(rgb):
    return min(PALETTE, key=lambda p: sum((a - b) ** 2 for a, b in zip(p[1], rgb)))[0]


def page_features(img):
    import numpy as np
    scale = 320 / img.width
    small = np.asarray(img.convert("RGB").resize((320, max(1, round(img.height * scale)))), dtype=np.int32)
    q = (small // 16) * 16 + 8  # quantised colours: [H, W, 3]
    codes = q[..., 0] * 65536 + q[..., 1] * 256 + q[..., 2]  # [H, W]
    decode = lambda c: (c // 65536, c // 256 % 256, c % 256)
    mode = lambda a: decode(int(np.bincount(a.ravel()).argmax())) if a.size else (255, 255, 255)
    row_mode = [int(np.bincount(r).argmax()) for r in codes]
    bands, start = [], 0  # runs of rows with the same dominant colour, at least 12 px (full scale) high
    for y in range(1, len(row_mode) + 1):
        if y == len(row_mode) or row_mode[y] != row_mode[start]:
            if (y - start) / scale >= 12:
                if bands and bands[-1][0] == row_mode[start]:
                    bands[-1][1] += y - start
                else:
                    bands.append([row_mode[start], y - start])
            start = y
    ink = np.abs(q - np.array([decode(c) for c in row_mode])[:, None, :]).sum(-1) > 90  # text and pictures
    xs = np.nonzero(ink)[1]
    centre = xs.mean() / 320 if len(xs) else 0.5
    return {"background": mode(codes), "header": mode(codes[: max(1, round(60 * scale))]),
            "footer": mode(codes[-max(1, round(50 * scale)):]), "blocks": [decode(c) for c, _ in bands],
            "height": img.height, "align": "left" if centre < 0.42 else "right" if centre > 0.58 else "centre",
            "text": mode(codes[ink]) if ink.any() else (0, 0, 0)}


def design_feedback(agent_img, target_img):
    """At most three sentences naming the most outstanding differences (deterministic)."""
    t = page_features(target_img)
    blocks = lambda f: ", ".join(colour_name(c) for c in f["blocks"]) or "none"
    if agent_img is None:
        return (f"I have not seen a page from you yet. I want a {colour_name(t['background'])} page with a "
                f"{colour_name(t['header'])} header and these colour blocks from top to bottom: {blocks(t)}. "
                f"The text is mostly {t['align']}-aligned.")
    a = page_features(agent_img)
    dist = lambda x, y: sum(abs(i - j) for i, j in zip(x, y)) / 765
    cands = []  # (how different, sentence)
    for part, what in (("header", "The top of the page"), ("background", "The page background"), ("footer", "The bottom of the page")):
        if colour_name(a[part]) != colour_name(t[part]):
            cands.append((dist(a[part], t[part]) + 0.1, f"{what} should be {colour_name(t[part])}, not {colour_name(a[part])}."))
    if len(a["blocks"]) != len(t["blocks"]):
        more = "missing some sections" if len(a["blocks"]) < len(t["blocks"]) else "extra sections"
        cands.append((0.3 + 0.1 * abs(len(a["blocks"]) - len(t["blocks"])),
                      f"Your page has {more}: I want these colour blocks from top to bottom: {blocks(t)} (yours: {blocks(a)})."))
    if a["align"] != t["align"]:
        cands.append((0.25, f"The text should be mostly {t['align']}-aligned, yours is {a['align']}-aligned."))
    ratio = a["height"] / t["height"]
    if ratio < 0.75 or ratio > 1.33:
        cands.append((min(abs(1 - ratio), 1.0) * 0.4, f"The page should be about {t['height']} pixels tall, yours is {a['height']}."))
    if colour_name(a["text"]) != colour_name(t["text"]):
        cands.append((dist(a["text"], t["text"]) * 0.5, f"The text should be {colour_name(t['text'])}, not {colour_name(a['text'])}."))
    if not cands:
        return "It looks very close to what I want."
    return " ".join(s for _, s in sorted(cands, key=lambda c: -c[0])[:3])


class ScriptedBackend:
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
            if hidden is not None:  # a page with hidden design facts (ours): a draft gets one fact, a question its lines
                if len(images) > 1:  # the hidden facts, then those of its request (in the system prompt)
                    request = system.split("HIDDEN INFORMATION", 1)[0]
                    return colbench.draft_reply(hidden, render.design_features(images[0]), colbench.design_in(request))
                return colbench.scripted_reply(hidden, texts[0] if texts else "")
            if images:
                return design_feedback(images[0] if len(images) > 1 else None, images[-1])
            last = " ".join(texts)
        parsed = self.human_template and colbench.parse_templated(self.human_template, last)
        if parsed:  # the released format: the template, with the whole transcript, in one user message
            hidden, last = parsed
        if hidden is not None:
            return colbench.scripted_reply(hidden, last)
        return "I don't know, sorry."


def make_handler(backend):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet: one line per request would flood a rollout's terminal
            pass

        def send_json(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self.send_json(200, {"object": "list", "data": [{"id": backend.name, "object": "model"}]})
            else:
                self.send_json(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            if self.path.rstrip("/") != "/v1/chat/completions":
                return self.send_json(404, {"error": {"message": f"no route {self.path}: this server answers only "
                                                                 f"/v1/chat/completions"}})
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if req.get("stream"):
                    raise ValueError("stream=true is not served")
                text = backend.chat(req["messages"])
                n_prompt = backend.count(json.dumps([m["content"] for m in req["messages"]]))
            except (KeyError, ValueError, TypeError) as e:
                return self.send_json(400, {"error": {"message": f"bad request: {e}"}})
            usage = {"prompt_tokens": n_prompt, "completion_tokens": backend.count(text)}
            self.send_json(200, {"id": f"cmpl-{time.time_ns()}", "created": int(time.time()), "model": backend.name,
                                 "object": "chat.completion", "usage": dict(usage, total_tokens=sum(usage.values())),
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": text}}]})
    return Handler


def serve(args):
    template = colbench.load_prompts(args.prompt_dir, "code")["human"] if args.prompt_dir else None
    server = ThreadingHTTPServer((args.host, args.port), make_handler(ScriptedBackend(template)))
    server.daemon_threads = True
    return server


if __name__ == "__main__":
    args = common.parse_args(Args, __doc__)
    try:
        server = serve(args)
    except common.DataError as e:
        sys.exit(f"error: {e}")
    print(f"simulated human ready at http://{args.host}:{server.server_address[1]}/v1", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
