"""A small OpenAI-compatible server for a TransformersPolicy, on loopback, with the standard library only.

It exists so the HTTP backend can be tested (and a local checkpoint shared by several processes) without vLLM:

    POST /v1/completions       prompt as text, token ids, or a list of either; logprobs of the sampled tokens;
                               `return_tokens_as_token_ids` (vLLM's extension) writes tokens as "token_id:N";
                               `return_token_ids` adds the generated ids to each choice
    POST /v1/chat/completions  messages rendered with the tokenizer's chat template; `logprobs` / `top_logprobs`
    GET  /v1/models            the one served model

Limits (it is a test server, not vLLM): n = 1, no streaming, no stop strings (replies end at the policy's stop
tokens or max_tokens), and top_logprobs lists hold only the sampled token. Requests are served one generate call
at a time; a completions request with several prompts is one batched generate call.

Hardening (every refusal is a JSON error body `{"error": {"message", "type", "code"}}`, never a dropped connection):
max_tokens must be in [1, max_tokens_limit] and is cut to what the model's context window leaves after the longest
prompt; request bodies above max_body_bytes get 413; a client that stops sending for read_timeout_s loses its
connection (408 when mid-body); at most max_workers connections are served at once and the rest get 503 at once;
malformed bodies (not a JSON object, bad token ids, NaN sampling values, a bad Content-Length) get 4xx; with an
api_key every request needs `Authorization: Bearer <key>` (401 otherwise), as `vllm serve --api-key` does.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import math
import os
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agentevo.models.backend import Generation, Sampling


class RequestError(Exception):
    """A request the server refuses: answered with `status` (400 unless said) and an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def _token_label(tokenizer: Any, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


def _real(body: dict[str, Any], key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value > high or value < low or (low_open and value == low):
        raise RequestError(f"{key} must be a number in {'(' if low_open else '['}{low:g}, {high:g}] (got {value!r})")
    return float(value)


def _integer(value: Any, key: str, low: int, high: int) -> int:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)  # JSON writers send 4e6 for 4000000
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"{key} must be an integer in [{low}, {high}] (got {value!r})")
    return value


def _sampling(body: dict[str, Any], default_max: int, max_limit: int) -> Sampling:
    if body.get("n", 1) != 1:
        raise RequestError("this server supports n = 1 only")
    if body.get("stream"):
        raise RequestError("this server does not stream")
    if body.get("stop"):
        raise RequestError("stop strings are not supported; replies end at the model's stop tokens")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    raw = body.get(key)
    max_tokens = min(default_max, max_limit) if raw is None else _integer(raw, key, 1, max_limit)
    seed = body.get("seed")
    top_k = 0 if body.get("top_k") is None else _integer(body["top_k"], "top_k", -1, 1 << 20)
    return Sampling(
        temperature=_real(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_real(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        max_new_tokens=max_tokens,
        seed=None if seed is None else _integer(seed, "seed", 0, 2**63 - 1),
        top_k=max(0, top_k),  # vLLM's -1 means off, like our 0
    )


class _BoundedServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with at most max_workers connections in service; the rest get 503 at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, max_workers: int) -> None:
        self._slots = threading.BoundedSemaphore(max_workers)
        self.refused_busy = 0
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused_busy += 1
            _refuse_busy(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _refuse_busy(sock: socket.socket) -> None:
    """Answer 503 on the accepting thread without waiting for the client (it never blocks the accept loop)."""
    data = json.dumps({"error": {"message": "the server is busy (all workers in use); retry shortly",
                                 "type": "server_busy", "code": 503}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n").encode()
    try:
        sock.setblocking(False)
        try:  # take what the client already sent, so closing does not reset the connection under the reply
            sock.recv(1 << 16)
        except OSError:
            pass
        sock.settimeout(1.0)
        sock.sendall(head + data)
    except OSError:
        pass


class PolicyServer:
    """Serves one policy at http://127.0.0.1:<port>/v1 from a background thread (port 0 = a free port)."""

    def __init__(
        self,
        policy: Any,
        model_name: str = "agentevo",
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_tokens_limit: int = 4096,
        context_window: int | None = None,
        max_body_bytes: int = 8 << 20,
        read_timeout_s: float = 30.0,
        max_workers: int = 32,
        api_key: str | None = None,
    ) -> None:
        self.policy, self.model_name = policy, model_name
        self._lock = threading.Lock()  # one generate call at a time: the model is not shared between threads
        self.requests = 0
        self.max_tokens_limit, self.max_body_bytes, self.api_key = max_tokens_limit, max_body_bytes, api_key
        model = getattr(policy, "model", None)
        config = getattr(model, "config", None)
        # the context window bounds prompt + reply; the embedding rows bound the token ids a prompt may hold
        self.context_window = context_window or getattr(config, "max_position_embeddings", None)
        embeddings = model.get_input_embeddings() if model is not None else None
        self.vocab_size = int(getattr(embeddings, "num_embeddings", 0) or len(policy.tokenizer))
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = read_timeout_s  # the socket's timeout: a silent client frees its worker

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence per-request logs
                return

            def _send(self, status: int, payload: dict[str, Any], close: bool = False,
                      headers: dict[str, str] | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                if close:  # the body was not read (or not all of it): this connection cannot carry another request
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, message: str, kind: str = "invalid_request_error", close: bool = False,
                       headers: dict[str, str] | None = None) -> None:
                self._send(status, {"error": {"message": message, "type": kind, "code": status}}, close, headers)

            def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
                """http.server's own refusals (bad request line, headers too long, no such method) as JSON."""
                try:
                    self._error(code, message or self.responses.get(code, ("error",))[0], close=True)
                except OSError:
                    self.close_connection = True

            def _authorized(self) -> bool:
                if server.api_key is None:
                    return True
                given = self.headers.get("Authorization", "").encode()
                return hmac.compare_digest(given, f"Bearer {server.api_key}".encode())

            def _refuse_unauthorized(self, close: bool = False) -> None:
                self._error(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                            "authentication_error", close, {"WWW-Authenticate": "Bearer"})

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if not self._authorized():
                    self._refuse_unauthorized()
                elif self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [
                        {"id": server.model_name, "object": "model", "owned_by": "agentevo"}]})
                else:
                    self._error(404, f"no route {self.path}", "not_found")

            def _not_allowed(self) -> None:
                self._error(405, f"method {self.command} is not allowed; use GET /v1/models or POST", close=True,
                            headers={"Allow": "GET, POST"})

            do_PUT = do_DELETE = do_PATCH = _not_allowed  # noqa: N815

            def _read_body(self) -> bytes | None:
                """The request body, or None after answering a refusal (bad or missing length, too large, slow)."""
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    self._error(411, "chunked request bodies are not supported; send Content-Length", close=True)
                    return None
                raw = self.headers.get("Content-Length")
                if raw is None:
                    self._error(411, "a POST needs a Content-Length header", close=True)
                    return None
                if not raw.strip().isdigit():  # rejects -1, 1e3 and junk: rfile.read(-1) would wait for EOF
                    self._error(400, f"Content-Length must be a non-negative integer (got {raw!r})", close=True)
                    return None
                length = int(raw)
                if length > server.max_body_bytes:
                    self._error(413, f"request body of {length} bytes is over this server's limit of "
                                f"{server.max_body_bytes} bytes", "request_too_large", close=True)
                    return None
                try:
                    data = self.rfile.read(length)
                except TimeoutError:
                    self._error(408, f"the request body did not arrive within {read_timeout_s:g} s", "timeout",
                                close=True)
                    return None
                if len(data) < length:  # the client closed mid-body
                    self.close_connection = True
                    return None
                return data

            def do_POST(self) -> None:  # noqa: N802
                data = self._read_body()
                if data is None:
                    return
                if not self._authorized():
                    self._refuse_unauthorized()
                    return
                route = self.path.rstrip("/")
                try:
                    try:
                        body = json.loads(data or b"{}")
                    except (ValueError, UnicodeDecodeError) as exc:
                        raise RequestError(f"the body is not valid JSON: {exc}") from None
                    if not isinstance(body, dict):
                        raise RequestError(f"the body must be a JSON object (got {type(body).__name__})")
                    if route == "/v1/completions":
                        self._send(200, server.completions(body))
                    elif route == "/v1/chat/completions":
                        self._send(200, server.chat_completions(body))
                    else:
                        self._error(404, f"no route {self.path}", "not_found")
                except RequestError as exc:
                    self._error(exc.status, str(exc), exc.kind)
                except Exception as exc:  # noqa: BLE001 - any other failure is the server's, still answered as JSON
                    self._error(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")

        self._httpd = _BoundedServer((host, port), Handler, max_workers)
        self.host, self.port = host, int(self._httpd.server_address[1])
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL clients use (ends with /v1)."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> PolicyServer:
        """Serve from a daemon thread; returns self."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="policy-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> PolicyServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- generation ------------------------------------------------------------------------------
    def _generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generation]:
        with self._lock:
            self.requests += 1
            return self.policy.generate(prompts, sampling)

    def _finish_reason(self, gen: Generation) -> str:
        return "stop" if gen.token_ids and gen.token_ids[-1] in self.policy.renderer.stop_ids else "length"

    def _encode(self, text: str) -> list[int]:
        return list(self.policy.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _token_ids(self, prompt: list[Any]) -> list[int]:
        for x in prompt:
            if isinstance(x, bool) or not isinstance(x, int):
                raise RequestError(f"token ids must be integers (got {x!r})")
            if not 0 <= x < self.vocab_size:
                raise RequestError(f"token id {x} is out of the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def _fit(self, prompts: list[list[int]], sampling: Sampling) -> Sampling:
        """max_tokens cut to what the context window leaves after the longest prompt."""
        if not self.context_window:
            return sampling
        longest = max(map(len, prompts))
        room = self.context_window - longest
        if room < 1:
            raise RequestError(f"a prompt of {longest} tokens leaves no room for a reply in the model's context "
                               f"window of {self.context_window} tokens")
        if sampling.max_new_tokens > room:
            sampling = dataclasses.replace(sampling, max_new_tokens=room)
        return sampling

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        """The /v1/completions answer for one request body."""
        prompt = body.get("prompt")
        shape = "prompt must be a string, a list of token ids, or a non-empty list of either"
        if isinstance(prompt, str):
            prompts = [self._encode(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(x, (int, float)) for x in prompt):
            prompts = [self._token_ids(prompt)]
        elif isinstance(prompt, list) and prompt:
            prompts = []
            for p in prompt:
                if not isinstance(p, (str, list)):
                    raise RequestError(f"{shape} (got an item {p!r})")
                prompts.append(self._encode(p) if isinstance(p, str) else self._token_ids(p))
        else:
            raise RequestError(shape)
        if any(not p for p in prompts):
            raise RequestError("empty prompt")
        sampling = self._fit(prompts, _sampling(body, 16, self.max_tokens_limit))
        gens = self._generate(prompts, sampling)
        as_ids = bool(body.get("return_tokens_as_token_ids", False))
        want_logprobs = body.get("logprobs") is not None
        tok = self.policy.tokenizer
        choices = []
        for k, gen in enumerate(gens):
            choice: dict[str, Any] = {"index": k, "text": gen.text, "finish_reason": self._finish_reason(gen)}
            if want_logprobs:
                labels = [_token_label(tok, t, as_ids) for t in gen.token_ids]
                offsets, pos = [], 0
                for t in gen.token_ids:
                    offsets.append(pos)
                    pos += len(tok.decode([t], skip_special_tokens=True))
                choice["logprobs"] = {
                    "tokens": labels,
                    "token_logprobs": list(gen.logprobs),
                    "top_logprobs": [{lab: lp} for lab, lp in zip(labels, gen.logprobs, strict=True)],
                    "text_offset": offsets,
                }
            else:
                choice["logprobs"] = None
            if body.get("return_token_ids"):
                choice["token_ids"] = list(gen.token_ids)
                choice["prompt_token_ids"] = prompts[k]
            choices.append(choice)
        n_prompt, n_gen = sum(map(len, prompts)), sum(len(g.token_ids) for g in gens)
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen},
        }

    def chat_completions(self, body: dict[str, Any]) -> dict[str, Any]:
        """The /v1/chat/completions answer for one request body."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content") or "", str):
                raise RequestError(f"each message must be an object with a string role and content (got {m!r})"[:300])
        payload = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
        sampling = _sampling(body, 256, self.max_tokens_limit)
        try:
            text = self.policy.tokenizer.apply_chat_template(payload, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template's own refusal (e.g. roles out of order)
            raise RequestError(f"the messages cannot be rendered with the chat template: {exc}") from None
        prompt = self._encode(text)
        if not prompt:
            raise RequestError("empty prompt")
        gen = self._generate([prompt], self._fit([prompt], sampling))[0]
        as_ids = bool(body.get("return_tokens_as_token_ids", False))
        logprobs = None
        if body.get("logprobs"):
            tok = self.policy.tokenizer
            content = []
            for t, lp in zip(gen.token_ids, gen.logprobs, strict=True):
                label = _token_label(tok, t, as_ids)
                entry = {"token": label, "logprob": lp, "bytes": list(tok.decode([t]).encode())}
                entry["top_logprobs"] = [dict(entry)] if body.get("top_logprobs") else []
                content.append(entry)
            logprobs = {"content": content}
        n_gen = len(gen.token_ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": gen.text}, "logprobs": logprobs,
                         "finish_reason": self._finish_reason(gen)}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_gen, "total_tokens": len(prompt) + n_gen},
        }


def main(argv: list[str] | None = None) -> None:
    """`python -m agentevo.models.serve MODEL_DIR [--port P]`: serve a local checkpoint until interrupted."""
    import argparse

    from agentevo.models.backend import TransformersPolicy, load_pretrained

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--name", default="agentevo")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-tokens-limit", type=int, default=4096,
                        help="largest max_tokens a request may ask for (also cut by the context window)")
    parser.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body (MiB); larger get 413")
    parser.add_argument("--read-timeout", type=float, default=30.0,
                        help="seconds a client may stay silent before its connection is closed")
    parser.add_argument("--max-workers", type=int, default=32,
                        help="connections served at once; more get 503")
    parser.add_argument("--api-key", default=os.environ.get("AGENTEVO_SERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $AGENTEVO_SERVE_API_KEY, else no key)")
    args = parser.parse_args(argv)
    for flag, value in (("--max-tokens-limit", args.max_tokens_limit), ("--max-workers", args.max_workers),
                        ("--max-body-mb", args.max_body_mb), ("--read-timeout", args.read_timeout)):
        if not value > 0 or not math.isfinite(value):
            parser.error(f"{flag} must be > 0 (got {value})")
    model, tokenizer = load_pretrained(args.model_dir)
    server = PolicyServer(TransformersPolicy(model, tokenizer, args.name, args.batch_size), args.name, args.host,
                          args.port, max_tokens_limit=args.max_tokens_limit, max_body_bytes=int(args.max_body_mb * 2**20),
                          read_timeout_s=args.read_timeout, max_workers=args.max_workers, api_key=args.api_key or None)
    print(f"serving {args.model_dir} at {server.url}", flush=True)
    server.start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
