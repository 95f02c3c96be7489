"""The OpenAI-compatible test server refuses bad requests with JSON errors and bounded resources; the HTTP client
retries malformed answers and gives up in one line within its deadline. Everything runs on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from agentevo.errors import AgentevoError
from agentevo.models.backend import Sampling
from agentevo.models.http_backend import HTTPConfig, HTTPPolicy
from agentevo.models.serve import PolicyServer


@pytest.fixture()
def server(tiny_policy):  # noqa: ANN001, ANN201
    with PolicyServer(tiny_policy, "tiny", max_tokens_limit=64, context_window=40, max_body_bytes=4096,
                      read_timeout_s=1.0, max_workers=3) as s:
        yield s


def _call(server: PolicyServer, method: str, path: str, body: bytes | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        conn.putrequest(method, path)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        if body is not None and "Content-Length" not in (headers or {}):
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _post(server: PolicyServer, payload: Any, route: str = "/v1/completions") -> tuple[int, dict[str, Any]]:
    return _call(server, "POST", route, json.dumps(payload).encode(), {"Content-Type": "application/json"})


def test_max_tokens_capped_by_limit_and_context(server, tiny_policy) -> None:  # noqa: ANN001
    for bad in (4e6, 10**9, 0, -3, 65, 2.5, "9", float("inf")):
        status, answer = _post(server, {"prompt": [5, 6, 7], "max_tokens": bad})
        assert status == 400 and answer["error"]["message"].startswith("max_tokens must be an integer in [1, 64]")
    assert server.requests == 0  # nothing reached the model
    # 30 prompt tokens in a 40-token window leave 10 for the reply, whatever max_tokens asks for
    status, answer = _post(server, {"prompt": [5] * 30, "max_tokens": 64, "temperature": 1.0, "seed": 0})
    assert status == 200 and answer["usage"]["completion_tokens"] <= 10
    status, answer = _post(server, {"prompt": [5] * 40, "max_tokens": 4})
    assert status == 400 and "leaves no room for a reply in the model's context window of 40 tokens" in \
        answer["error"]["message"]
    status, answer = _post(server, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1e9},
                           "/v1/chat/completions")
    assert status == 400 and "max_completion_tokens must be an integer in [1, 64] (got 1000000000)" in \
        answer["error"]["message"]


@pytest.mark.parametrize(("payload", "message"), [
    ([1, 2], "the body must be a JSON object (got list)"),
    (None, "the body must be a JSON object (got NoneType)"),
    ("text", "the body must be a JSON object (got str)"),
    ({"prompt": [3, -1]}, "token id -1 is out of the vocabulary [0, "),
    ({"prompt": [3, 10**6]}, "token id 1000000 is out of the vocabulary [0, "),
    ({"prompt": [[3, 4], [2.5]]}, "token ids must be integers (got 2.5)"),
    ({"prompt": [3, True]}, "token ids must be integers (got True)"),
    ({"prompt": [[3], {"a": 1}]}, "prompt must be a string, a list of token ids, or a non-empty list of either"),
    ({"prompt": []}, "prompt must be a string"),
    ({"prompt": [3], "temperature": float("nan")}, "temperature must be a number in [0, 100] (got nan)"),
    ({"prompt": [3], "top_p": 0}, "top_p must be a number in (0, 1] (got 0)"),
    ({"prompt": [3], "seed": -2}, "seed must be an integer in [0, "),
    ({"prompt": [3], "n": "2"}, "this server supports n = 1 only"),
    ({"messages": [{"role": "user"}, "x"]}, "each message must be an object with a string role and content"),
    ({"messages": [{"role": 3, "content": "a"}]}, "each message must be an object"),
])
def test_malformed_bodies_get_400_json(server, payload, message) -> None:  # noqa: ANN001
    route = "/v1/chat/completions" if isinstance(payload, dict) and "messages" in payload else "/v1/completions"
    status, answer = _post(server, payload, route)
    assert status == 400 and answer["error"]["message"].startswith(message), answer
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["code"] == 400


def test_bad_framing_gets_4xx_json(server) -> None:  # noqa: ANN001
    status, answer = _call(server, "POST", "/v1/completions", b"{", {"Content-Length": "1"})
    assert status == 400 and answer["error"]["message"].startswith("the body is not valid JSON")
    for length in ("-1", "abc", "1e3"):
        status, answer = _call(server, "POST", "/v1/completions", b"", {"Content-Length": length})
        assert (status, answer["error"]["message"]) == (
            400, f"Content-Length must be a non-negative integer (got {length!r})")
    status, answer = _call(server, "POST", "/v1/completions", None, {})
    assert status == 411 and answer["error"]["message"] == "a POST needs a Content-Length header"
    status, answer = _call(server, "POST", "/v1/completions", b"", {"Content-Length": str(50 << 20)})
    assert status == 413 and answer["error"]["message"] == (
        "request body of 52428800 bytes is over this server's limit of 4096 bytes")
    status, answer = _post(server, {"prompt": "x" * 5000})
    assert status == 413
    status, answer = _call(server, "DELETE", "/v1/models")
    assert status == 405 and "method DELETE is not allowed" in answer["error"]["message"]
    status, answer = _call(server, "GET", "/v2/nothing")
    assert status == 404 and answer["error"]["type"] == "not_found"
    assert _post(server, {"prompt": [5, 6], "max_tokens": 2})[0] == 200  # and the server still works


def _threads() -> int:
    return threading.active_count()


def _wait_for_threads(target: int, *, at_most: bool = False, timeout: float = 5.0) -> int:
    """Wait until the live thread count is target (or at most target); a worker frees its slot before its thread ends."""
    deadline = time.monotonic() + timeout
    while (_threads() > target if at_most else _threads() != target) and time.monotonic() < deadline:
        time.sleep(0.02)
    return _threads()


def test_slow_clients_time_out_and_the_pool_is_bounded(server) -> None:  # noqa: ANN001
    before = _threads()
    # a body that never fully arrives: 408 after read_timeout_s (1 s), and the worker is freed
    slow = socket.create_connection((server.host, server.port), timeout=5)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    t0 = time.monotonic()
    reply = b""
    while chunk := slow.recv(4096):  # the server closes the connection after its answer
        reply += chunk
    reply = reply.decode()
    assert reply.startswith("HTTP/1.1 408") and "did not arrive within 1 s" in reply
    assert time.monotonic() - t0 < 4
    slow.close()
    # the client sees the close before the worker releases its slot: wait for the worker to end
    assert _wait_for_threads(before, at_most=True) <= before
    # three silent connections fill the pool (max_workers = 3): a fourth gets 503 at once, as JSON
    idle = [socket.create_connection((server.host, server.port), timeout=5) for _ in range(3)]
    assert _wait_for_threads(before + 3) == before + 3  # all three in service
    extra = socket.create_connection((server.host, server.port), timeout=5)
    head, _, body = extra.recv(4096).decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 503") and json.loads(body)["error"]["type"] == "server_busy"
    assert server._httpd.refused_busy == 1 and _threads() <= before + 3
    extra.close()
    # the silent ones are dropped after read_timeout_s, and the pool serves again
    for sock in idle:
        assert sock.recv(4096) == b""
        sock.close()
    assert _wait_for_threads(before, at_most=True) <= before
    assert _post(server, {"prompt": [5, 6], "max_tokens": 2})[0] == 200


def test_api_key_is_required_when_set(tiny_policy) -> None:  # noqa: ANN001
    with PolicyServer(tiny_policy, "tiny", api_key="s3cret") as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, answer = _call(s, "GET", "/v1/models", None, headers)
            assert status == 401 and answer["error"]["type"] == "authentication_error"
            status, _ = _call(s, "POST", "/v1/completions", b'{"prompt": [3]}', headers)
            assert status == 401
        assert s.requests == 0
        status, answer = _call(s, "GET", "/v1/models", None, {"Authorization": "Bearer s3cret"})
        assert status == 200 and answer["data"][0]["id"] == "tiny"
        with pytest.raises(AgentevoError, match="answered 401: .*missing or wrong API key"):
            HTTPPolicy(s.url, model="tiny", api_key="nope").complete("hi", Sampling(max_new_tokens=2))
        keyed = HTTPPolicy(s.url, api_key="s3cret")
        assert keyed.model == "tiny" and isinstance(keyed.complete("hi", Sampling(max_new_tokens=2)), str)


# -- the client against a misbehaving server ----------------------------------------------------------------------


class _BadServer:
    """Answers every request with one fixed misbehaviour and counts the requests."""

    def __init__(self, mode: str) -> None:
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

            def do_POST(self) -> None:  # noqa: N802
                outer.hits += 1
                self.rfile.read(int(self.headers["Content-Length"]))
                if mode == "hang":
                    time.sleep(3)
                    return
                data = {"html": b"<html>\n<b>Bad gateway</b></html>", "truncated": b'{"choices": [{"te',
                        "no_choices": b'{"object": "error"}'}[mode]
                self.send_response(200)
                self.send_header("Content-Length", str(100 if mode == "truncated" else len(data)))
                self.end_headers()
                self.wfile.write(data)
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize(("mode", "last"), [
    ("html", "the last gave a 200 answer that is not JSON: '<html> <b>Bad gateway</b></html>'"),
    ("truncated", "the last gave a reply cut short after 17 bytes"),
    ("no_choices", "the last gave a 200 answer without a 'choices' list: '{\"object\": \"error\"}'"),
])
def test_client_retries_malformed_answers_then_fails_in_one_line(mode, last) -> None:  # noqa: ANN001
    bad = _BadServer(mode)
    try:
        client = HTTPPolicy(bad.url, model="m", retries=1, timeout_s=5)
        with pytest.raises(AgentevoError) as info:
            client.complete("hi")
        msg = str(info.value)
        assert bad.hits == 2 and "\n" not in msg  # retried once, then one line
        assert msg.startswith(f"no answer from the OpenAI-compatible server at {bad.url}/chat/completions could be "
                              "used: 2 tries within 200 s, ")
        assert last in msg
    finally:
        bad.close()


def test_client_total_wait_is_bounded_by_the_deadline() -> None:
    bad = _BadServer("hang")
    try:
        client = HTTPPolicy(bad.url, model="m", retries=10, timeout_s=0.4, deadline_s=1.2)
        t0 = time.monotonic()
        with pytest.raises(AgentevoError, match=r"within 1.2 s, the last gave TimeoutError"):
            client.complete("hi")
        assert time.monotonic() - t0 < 2.0 and 2 <= bad.hits <= 3
    finally:
        bad.close()
    cfg = HTTPConfig()
    assert (cfg.timeout_s, cfg.retries, cfg.deadline_s) == (60.0, 2, 200.0)
    assert cfg.timeout_s * (cfg.retries + 1) + 0.5 + 1.0 <= cfg.deadline_s  # the documented 60 s x 3 tries fit
