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
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agentevo.models.backend import Generation, Sampling


class RequestError(Exception):
    """A request the server refuses (answered with HTTP 400 and an OpenAI-style error body)."""


def _token_label(tokenizer: Any, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


def _sampling(body: dict[str, Any], default_max: int) -> Sampling:
    if int(body.get("n", 1)) != 1:
        raise RequestError("this server supports n = 1 only")
    if body.get("stream"):
        raise RequestError("this server does not stream")
    if body.get("stop"):
        raise RequestError("stop strings are not supported; replies end at the model's stop tokens")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max))
    seed = body.get("seed")
    return Sampling(
        temperature=float(body.get("temperature", 1.0)),
        top_p=float(body.get("top_p", 1.0)),
        max_new_tokens=int(max_tokens),
        seed=None if seed is None else int(seed),
        top_k=int(body.get("top_k", 0)),
    )


class PolicyServer:
    """Serves one policy at http://127.0.0.1:<port>/v1 from a background thread (port 0 = a free port)."""

    def __init__(self, policy: Any, model_name: str = "agentevo", host: str = "127.0.0.1", port: int = 0) -> None:
        self.policy, self.model_name = policy, model_name
        self._lock = threading.Lock()  # one generate call at a time: the model is not shared between threads
        self.requests = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence per-request logs
                return

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [
                        {"id": server.model_name, "object": "model", "owned_by": "agentevo"}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", 0))
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                    route = self.path.rstrip("/")
                    if route == "/v1/completions":
                        self._send(200, server.completions(body))
                    elif route == "/v1/chat/completions":
                        self._send(200, server.chat_completions(body))
                    else:
                        self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                except (RequestError, ValueError, TypeError, KeyError) as exc:
                    self._send(400, {"error": {"message": str(exc), "type": "invalid_request_error"}})

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
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

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        """The /v1/completions answer for one request body."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [self._encode(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            prompts = [list(prompt)]
        elif isinstance(prompt, list) and prompt:
            prompts = [self._encode(p) if isinstance(p, str) else [int(x) for x in p] for p in prompt]
        else:
            raise RequestError("prompt must be a string, a list of token ids, or a non-empty list of either")
        if any(not p for p in prompts):
            raise RequestError("empty prompt")
        sampling = _sampling(body, 16)
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
        payload = [{"role": str(m["role"]), "content": str(m.get("content") or "")} for m in messages]
        text = self.policy.tokenizer.apply_chat_template(payload, tokenize=False, add_generation_prompt=True)
        prompt = self._encode(text)
        gen = self._generate([prompt], _sampling(body, 256))[0]
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
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    model, tokenizer = load_pretrained(args.model_dir)
    server = PolicyServer(TransformersPolicy(model, tokenizer, args.name, args.batch_size), args.name, port=args.port)
    print(f"serving {args.model_dir} at {server.url}", flush=True)
    server.start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
