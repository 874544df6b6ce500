"""The embedded simulated human: an OpenAI-compatible server on localhost (GET /v1/models, POST
/v1/chat/completions), so rollout.py talks to it exactly as it would to `vllm serve
meta-llama/Llama-3.1-70B-Instruct`. Replies carry `usage` in words and punctuation marks.

    python simulator.py                          # scripted human on http://127.0.0.1:8000/v1
    python simulator.py --port 0                 # any free port; the URL is printed when ready

The scripted human (deterministic, instant on CPU) reads the hidden information out of the human
prompt (colbench.HUMAN_PROMPT, or with --prompt_dir the folder's code human template, in the
released format) and answers the agent's last message with at most two hidden lines that share the
most words with it, or says it doesn't know. On procedural pages (colbench.DESIGN_FACTS) it quotes
the most important hidden fact a shown draft gets wrong, read from the draft's pixels. ColBench's
own frontend tasks need a vision-language model as the human (`vllm serve Qwen/Qwen2-VL-72B-Instruct`).

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
