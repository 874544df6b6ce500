"""A misbehaving OpenAI-compatible server for the fault-injection tests, run as its own process:
    python tests/fault_server.py 500 PORT     # every chat request answers HTTP 500
    python tests/fault_server.py hang PORT    # every chat request hangs
GET /v1/models answers normally, so clients start."""
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

mode, port = sys.argv[1], int(sys.argv[2])


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply(200, {"data": [{"id": "faulty"}]})

    def do_POST(self):
        if mode == "hang":
            time.sleep(3600)
        self.reply(500, {"error": "injected failure"})


server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
server.daemon_threads = True
print(f"ready at http://127.0.0.1:{server.server_address[1]}/v1", flush=True)
server.serve_forever()
