"""The embedded simulated human: an OpenAI-compatible server on localhost (GET /v1/models, POST
/v1/chat/completions), so rollout.py talks to it exactly as it would to `vllm serve
meta-llama/Llama-3.1-70B-Instruct`. Replies carry `usage` in words and punctuation marks.

    python simulator.py                          # scripted human on http://127.0.0.1:8000/v1
    python simulator.py --port 0                 # any free port; the URL is printed when ready

The human it serves is colbench/human.py's scripted one (with --prompt_dir it reads the hidden information out of
that folder's code human template, in the released format). ColBench's own frontend tasks need a vision-language
model as the human (`vllm serve Qwen/Qwen2-VL-72B-Instruct`).

Deviation from the paper: the scripted human replaces Llama-3.1-70B on CPU; it never paraphrases and
answers only when the question shares words with a hidden fact.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import colbench
import common
from colbench.human import ScriptedHuman


@dataclass
class Args:
    host: str = "127.0.0.1"
    """interface to listen on"""
    port: int = 8000
    """port (0 = pick a free one)"""
    prompt_dir: str = ""
    """the folder of prompt templates rollout.py uses (--prompt_dir), to find the hidden information"""


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
    server = ThreadingHTTPServer((args.host, args.port), make_handler(ScriptedHuman(template)))
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
