from __future__ import annotations

import sys

import httpx
import pytest

from gapless.bench.launch import launched_server, serve_command
from tests.server import free_port

SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_serve_command():
    cmd = serve_command(1234, ["--model", "m"])
    assert cmd[1:] == ["-m", "gapless.launch.cli", "serve", "--port", "1234", "--model", "m"]
    assert cmd[0] == sys.executable


def test_server_is_stopped_after_an_error():
    port = free_port()
    command = [sys.executable, "-c", SERVER, str(port)]
    with pytest.raises(KeyboardInterrupt):
        with launched_server(command=command, port=port, startup_timeout_s=30) as url:
            assert httpx.get(url + "/health").status_code == 200
            raise KeyboardInterrupt
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_a_server_that_dies_at_startup_is_reported():
    command = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="(?s)exited with 3.*no model here"):
        with launched_server(command=command, port=free_port(), startup_timeout_s=30):
            pass
