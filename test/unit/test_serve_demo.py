"""The GPU demo's HTTP side against a stand-in server (no GPU): health wait, questions
over /generate, and the summary from /get_server_info."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

pytest.importorskip("requests", reason="requests is not installed")

from sglang_psa import serve_demo  # noqa: E402
from sglang_psa.eval.tasks import Task  # noqa: E402


class _Handler(BaseHTTPRequestHandler):
    seen: list = []

    def log_message(self, *args):  # quiet
        pass

    def _send(self, body: dict, code: int = 200):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self._send({})
        if self.path == "/get_server_info":
            return self._send({"internal_states": [{"psa": {"blocks_read_fraction": 0.25}}]})
        self._send({}, 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.seen.append(body)
        answer = "Paris" if len(body["input_ids"]) % 2 else "Rome"
        self._send({"text": f" {answer}\n"})


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


class _Tok:
    chat_template = None

    def __call__(self, s, add_special_tokens=False):
        return {"input_ids": [1] * len(s.split())}


def test_health_wait_and_questions_over_generate(server, tmp_path, capsys):
    alive = SimpleNamespace(poll=lambda: None, returncode=None)
    serve_demo.wait_healthy(alive, server, tmp_path / "log", timeout=10)
    tasks = [
        Task("t", "doc", "Where? one", ("Paris",), 5),
        Task("t", "doc", "Where? one two", ("Paris",), 7),
    ]
    right = serve_demo.ask(server, _Tok(), "a b c", tasks)
    out = capsys.readouterr().out
    assert right == sum("Paris" in ln for ln in out.splitlines() if ln.strip().startswith("->"))
    assert [b["sampling_params"]["max_new_tokens"] for b in _Handler.seen[-2:]] == [5, 7]
    assert all(b["sampling_params"]["temperature"] == 0 for b in _Handler.seen[-2:])


def test_a_dead_server_is_reported_with_its_log(tmp_path):
    dead = SimpleNamespace(poll=lambda: 3, returncode=3)
    with pytest.raises(SystemExit, match="exited .code 3.*log"):
        serve_demo.wait_healthy(dead, "http://127.0.0.1:9", tmp_path / "log", timeout=5)


def test_a_server_is_launched_with_its_own_variables_over_this_environment(tmp_path, monkeypatch):
    """`launch(env=)`: the server process gets this process's environment with `env` over
    it (the reliability probes force retraction at the tiered home so); without `env`,
    this environment as it is."""
    seen = []
    monkeypatch.setattr(serve_demo.subprocess, "Popen", lambda cmd, **kw: seen.append(kw))
    monkeypatch.setenv("PSA_TEST_OUTER", "kept")
    monkeypatch.setenv("SGLANG_TEST_RETRACT", "0")
    serve_demo.launch(tmp_path, 30999, [], tmp_path / "a.log", {"SGLANG_TEST_RETRACT": "1"})
    serve_demo.launch(tmp_path, 30999, [], tmp_path / "b.log")
    env = seen[0]["env"]
    assert env["SGLANG_TEST_RETRACT"] == "1" and env["PSA_TEST_OUTER"] == "kept"
    assert seen[1]["env"] is None  # inherited unchanged
