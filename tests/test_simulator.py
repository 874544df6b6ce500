"""The simulated human over real HTTP on localhost, and the client's retries."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import colbench
import common

TASK = {"problem_description": "Label a score. The signature of the function is: def grade_exam(score)",
        "hidden_information": "A score of 62 or more gets the label 'gold'.\nA score below 62 gets the label 'silver'.\n"
                              "The shop opens at 9.", "ground_truth": "", "test_cases": {}}


def ask(url, question):
    client = common.ChatClient(url)
    dialogue = [{"role": "user", "content": TASK["problem_description"]}, {"role": "assistant", "content": question}]
    return client.chat(colbench.human_messages(TASK, dialogue), temperature=0.0)


def test_models_and_scripted_answers(simulator_url):
    assert common.ChatClient(simulator_url).model == "scripted-human"
    reply = ask(simulator_url, "What score gets the label gold?")
    assert "62" in reply and "shop" not in reply and len(reply) <= colbench.HUMAN_MAX_CHARS["code"]
    assert ask(simulator_url, "What is your favourite colour?") == "I don't know, sorry."
    assert ask(simulator_url, "When does the shop open?") == "The shop opens at 9."


def test_scripted_reply_says_one_line_the_most_relevant_and_code_lines():
    hidden = "a b c\nscore rule one\nscore rule two\nscore rule three"
    assert colbench.scripted_reply(hidden, "what is the score rule?") == "score rule one"  # a tie: the first line
    assert colbench.scripted_reply(hidden, "the score rule two?") == "score rule two"
    code = "def f(price, qty):\n    discount = 0.15\n    return price * qty * (1 - discount)"
    assert colbench.scripted_reply(code, "Is there a discount?") == "discount = 0.15"
    assert colbench.scripted_reply(code, "Is there a discount?", max_lines=2) == "discount = 0.15\nreturn price * qty * (1 - discount)"
    assert colbench.scripted_reply(code, "What about the weather?") == "I don't know, sorry."


def test_bad_requests_get_400_and_unknown_routes_404(simulator_url):
    import requests
    assert requests.post(simulator_url + "/v1/chat/completions", data="{oops").status_code == 400
    assert requests.get(simulator_url + "/v1/nothing").status_code == 404


FINE = json.dumps({"choices": [{"message": {"role": "assistant", "content": "fine"}}]}).encode()


def fake_server(do_post):
    """A real local HTTP server whose POST handler is do_post(handler), and a ChatClient for it."""
    handler = type("Handler", (BaseHTTPRequestHandler,), {"log_message": lambda self, *a: None, "do_POST": do_post})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return common.ChatClient(f"http://127.0.0.1:{server.server_address[1]}", model="m", backoff=0.01), server


def send_fine(handler, body=FINE):
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(FINE)))
    handler.end_headers()
    handler.wfile.write(body)


def test_client_retries_5xx_then_succeeds():
    calls = []

    def do_post(self):
        calls.append(1)
        if len(calls) < 3:
            self.send_response(503)
            self.end_headers()
            return
        send_fine(self)

    client, server = fake_server(do_post)
    assert client.chat([{"role": "user", "content": "hi"}]) == "fine" and len(calls) == 3
    server.shutdown()


def test_client_retries_a_reply_cut_off_mid_body():
    """A server killed while writing a reply leaves a short body (IncompleteRead): retried, not an error."""
    calls = []

    def do_post(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        calls.append(1)
        send_fine(self, FINE if len(calls) > 1 else FINE[:5])  # the first reply stops after 5 bytes
        self.close_connection = True

    client, server = fake_server(do_post)
    assert client.chat([{"role": "user", "content": "x"}]) == "fine" and len(calls) == 2
    server.shutdown()


def test_unreachable_server_is_a_clear_error():
    with pytest.raises(ConnectionError, match=r"failed \d+ times in 0.05 s.*simulator.py"):
        common.ChatClient("http://127.0.0.1:9", model="m", retry_time=0.05, backoff=0.02).chat([{"role": "user", "content": "x"}])


def test_simulator_script_prints_its_url():
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "simulator.py", "--port", "0"], cwd=common.Path(common.__file__).parent,
                         stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert "ready at http://127.0.0.1:" in line
        url = line.split("ready at ")[1].strip()
        assert common.ChatClient(url).model == "scripted-human"
    finally:
        p.kill()


def test_official_openai_client_gets_usage(simulator_url):
    """simulator.py as a user's own tools see it: the official `openai` client lists models and gets a
    reply with usage; a streamed request is refused in words (HTTP 400), never answered empty."""
    import openai
    client = openai.OpenAI(base_url=simulator_url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list()] == ["scripted-human"]
    dialogue = [{"role": "user", "content": TASK["problem_description"]},
                {"role": "assistant", "content": "What score gets the label gold?"}]
    messages = colbench.human_messages(TASK, dialogue)
    reply = client.chat.completions.create(model="scripted-human", messages=messages, temperature=0)
    text = reply.choices[0].message.content
    assert "62" in text and reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens > 20 and reply.usage.completion_tokens > 3
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="stream=true is not served"):
        client.chat.completions.create(model="scripted-human", messages=messages, temperature=0, stream=True)


def test_4xx_is_one_line_quoting_the_server(simulator_url, task_files, tiny_model, tmp_path):
    """A request the server refuses (here /v1/completions, which the simulated human does not serve) is
    one ServerError line that quotes the server's message, at once (no retries), and a stage turns it
    into `error: ...` without a traceback."""
    import subprocess
    import sys
    import time
    from conftest import ROOT
    client = common.ChatClient(simulator_url, retry_time=60)
    t0 = time.monotonic()
    with pytest.raises(common.RequestRefused, match=r"HTTP 404: no route /v1/completions: this server answers only "
                                                    r"/v1/chat/completions") as e:
        client.complete("hello")
    assert e.value.status == 404 and "\n" not in str(e.value) and time.monotonic() - t0 < 5
    train, _ = task_files  # rollout with the scripted human as its (refusing) agent server
    p = subprocess.run([sys.executable, "rollout.py", "--tasks", str(train), "--output", str(tmp_path / "r.jsonl"),
                        "--num_tasks", "1", "--agent_backend", "openai", "--agent_url", simulator_url,
                        "--agent_model", tiny_model, "--simulator_url", simulator_url],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].startswith("error: POST ") and "HTTP 404: no route" in p.stderr
