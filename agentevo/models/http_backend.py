"""A policy that acts through any OpenAI-compatible server (vLLM's `vllm serve`, SGLang, TGI, a hosted API).

Two ways to act, chosen by `mode`:

* ``completions`` (default): the prompt is sent as the token ids the local renderer produced (history replies
  spliced in as stored ids), to ``/v1/completions`` with ``logprobs`` and vLLM's ``return_tokens_as_token_ids``.
  When the server returns token ids, a Generation holds exactly what the server sampled and its log-probs, the
  same as TransformersPolicy, and the trajectories can train ratio-based methods. vLLM's default logprobs mode is
  ``raw_logprobs`` (before temperature), which matches the temperature-1 convention of the stored behaviour
  log-probs.
* ``chat``: for servers without token-id prompts (most hosted APIs). The conversation is sent as text messages
  to ``/v1/chat/completions``; the server renders its own prompt. Use `http_actor` to build the actor.

What is kept when the server gives no token ids (chat mode always, completions mode on servers that do not
return ids): the reply text; token ids from the local tokenizer (`renderer.encode_reply`, which re-tokenizes the
text, and may differ from what the server sampled); and **no log-probs** (Generation.logprobs is empty, so
Step.logprobs is None). In chat mode log-probs are dropped even when the server reports them, because they are
log pi(a | the server's rendering of the text history), a context the trainer cannot rebuild token for token.
Such trajectories can train likelihood methods on their text (BC/SFT, RFT) but **not ratio-based methods**
(Q-Evolve's BPPO ratio, GRPO, Self-Guide), which need the behaviour log-probs of the exact ids: those recipes
must refuse steps whose logprobs are None.

`complete(prompt_text)` is a plain text-in, text-out call (RSD's lesson/reflection writers and rule proposer).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentevo.agent.chat import ChatRenderer
from agentevo.agent.prompt import build_messages
from agentevo.errors import AgentevoError, ConfigError
from agentevo.options import check_choice, check_fields, option

if TYPE_CHECKING:  # backend imports torch; this module stays light so config.py can import HTTPConfig
    from agentevo.models.backend import Generation, Sampling

MODES = ("completions", "chat")


def _snippet(raw: bytes, limit: int = 200) -> str:
    """The start of a server's answer on one line (for error messages)."""
    text = " ".join(raw.decode(errors="replace").split())
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


@dataclass
class HTTPConfig:
    """An OpenAI-compatible endpoint used as the policy (model.backend = http)."""

    base_url: str = option("server base URL, ending in /v1 (e.g. http://127.0.0.1:8000/v1)", "http://127.0.0.1:8000/v1")
    model: str | None = option("model name sent with each request (null = the first one /v1/models lists)", None)
    mode: str = option("'completions' (token-id prompts, ids and log-probs kept) or 'chat' (text only)", "completions")
    api_key_env: str | None = option("environment variable holding the API key (null = no key)", None)
    timeout_s: float = option("seconds to wait for one HTTP answer (connect, and each read of the reply); a slower "
                              "answer counts as a failed try", 60.0, gt=0, le=3600)
    max_concurrency: int = option("requests in flight at once (chat mode sends one request per episode)", 16, ge=1)
    retries: int = option("retries of a request that failed to connect, got a 5xx answer or a malformed one "
                          "(not JSON, cut short); by default 60 s x 3 tries", 2, ge=0, le=20)
    deadline_s: float = option("most seconds one request may take in all, tries and back-off waits included; then "
                               "it fails with an error naming the server", 200.0, gt=0)

    def validate(self) -> None:
        check_fields(self, "model.http")  # the ranges declared on the fields
        check_choice("model.http", "mode", self.mode, MODES)
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"model.http.base_url must start with http:// or https:// (got {self.base_url!r})")


class HTTPPolicy:
    """A policy behind an OpenAI-compatible server: generate(), chat(), complete(), renderer, policy_id, pad_id."""

    def __init__(
        self,
        base_url: str,
        tokenizer: Any = None,
        model: str | None = None,
        policy_id: str = "http",
        mode: str = "completions",
        api_key: str | None = None,
        timeout_s: float = 60.0,
        batch_size: int = 16,
        max_concurrency: int = 16,
        retries: int = 2,
        deadline_s: float = 200.0,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"HTTPPolicy mode must be one of {', '.join(MODES)} (got {mode!r})")
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer) if tokenizer is not None else None
        self.pad_id = 0
        if tokenizer is not None:
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            self.pad_id = int(tokenizer.pad_token_id)
        self.policy_id, self.mode = policy_id, mode
        self.api_key, self.timeout_s, self.retries, self.deadline_s = api_key, timeout_s, retries, deadline_s
        self.batch_size, self.max_concurrency = batch_size, max_concurrency
        self._model = model
        self.requests = 0  # HTTP requests sent (tests and logs)

    @classmethod
    def from_config(cls, cfg: HTTPConfig, tokenizer: Any, policy_id: str = "http", batch_size: int = 16) -> HTTPPolicy:
        """A policy from the model.http config section."""
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        return cls(cfg.base_url, tokenizer, cfg.model, policy_id, cfg.mode, key, cfg.timeout_s, batch_size,
                   cfg.max_concurrency, cfg.retries, cfg.deadline_s)

    # -- transport ---------------------------------------------------------------------------------
    def _request(self, route: str, payload: dict[str, Any] | None = None, expect: str = "choices") -> dict[str, Any]:
        """One call, retried on connection failures, 5xx answers and malformed answers, within deadline_s."""
        url = f"{self.base_url}/{route}"
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last, tries = "nothing", 0
        deadline = time.monotonic() + self.deadline_s
        for attempt in range(self.retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            req = urllib.request.Request(url, data=data, headers=headers, method="GET" if data is None else "POST")
            tries += 1
            raw = b""
            try:
                self.requests += 1
                with urllib.request.urlopen(req, timeout=min(self.timeout_s, left)) as resp:
                    raw = resp.read()
                answer = json.loads(raw)
                if isinstance(answer, dict) and isinstance(answer.get(expect), list):
                    return answer
                last = f"a 200 answer without a {expect!r} list: {_snippet(raw)}"
            except urllib.error.HTTPError as exc:
                detail = _snippet(exc.read())
                if exc.code < 500:  # the server refused the request itself: retrying will not help
                    raise AgentevoError(f"{url} answered {exc.code}: {detail}") from exc
                last = f"HTTP {exc.code}: {detail}"
            except (ValueError, UnicodeDecodeError):  # json.JSONDecodeError is a ValueError
                last = f"a 200 answer that is not JSON: {_snippet(raw)}"
            except http.client.IncompleteRead as exc:
                last = f"a reply cut short after {len(exc.partial)} bytes"
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, OSError) as exc:
                last = " ".join(repr(exc).split())
            pause = min(8.0, 0.5 * 2**attempt, deadline - time.monotonic())
            if attempt < self.retries and pause > 0:
                time.sleep(pause)
        raise AgentevoError(
            f"no answer from the OpenAI-compatible server at {url} could be used: {tries} tries within "
            f"{self.deadline_s:g} s, the last gave {last}; is it running, and is model.http.base_url right?"
        )

    def _chat_reply(self, answer: dict[str, Any]) -> tuple[str, str | None]:
        """(content, finish_reason) of a chat answer's first choice; a malformed choice is a one-line error."""
        choice = answer["choices"][0] if answer["choices"] else None
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            raise AgentevoError(f"{self.base_url}/chat/completions answered a choice without a message: "
                                f"{_snippet(json.dumps(answer).encode())}")
        return str(message.get("content") or ""), choice.get("finish_reason")

    @property
    def model(self) -> str:
        """The served model name (asked from /v1/models once when not given)."""
        if self._model is None:
            listed = self._request("models", expect="data")["data"]
            ids = [m["id"] for m in listed if isinstance(m, dict) and m.get("id")]
            if not ids:
                raise AgentevoError(f"{self.base_url}/models lists no model; set model.http.model")
            self._model = str(ids[0])
        return self._model

    def _need_renderer(self) -> ChatRenderer:
        if self.renderer is None:
            raise ConfigError("this HTTPPolicy has no tokenizer: acting in an environment needs the model's tokenizer")
        return self.renderer

    # -- acting --------------------------------------------------------------------------------------
    def _sampling_fields(self, sampling: Sampling, chat: bool = False) -> dict[str, Any]:
        # chat: max_completion_tokens (current OpenAI models refuse max_tokens; vLLM and SGLang accept both)
        fields: dict[str, Any] = {"max_completion_tokens" if chat else "max_tokens": sampling.max_new_tokens,
                                  "temperature": 0.0 if sampling.greedy else sampling.temperature,
                                  "top_p": 1.0 if sampling.greedy else sampling.top_p}
        if sampling.seed is not None:
            fields["seed"] = sampling.seed
        if sampling.top_k > 0 and not sampling.greedy:
            fields["top_k"] = sampling.top_k  # an extension vLLM, SGLang and our server accept; OpenAI does not
        return fields

    def _text_only(self, text: str, finish_reason: str | None) -> Generation:
        """A reply known only as text: local token ids (ending the turn unless it was cut) and no log-probs."""
        from agentevo.models.backend import Generation

        renderer = self._need_renderer()
        if finish_reason == "length":  # cut at max_tokens: no end-of-turn token was produced
            ids = list(renderer.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
        else:
            ids = renderer.encode_reply(text)
        return Generation(ids, [], text)

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generation]:
        """Replies to token-id prompts via /v1/completions (batched, batch_size prompts per request)."""
        if self.mode != "completions":
            raise ConfigError("an HTTPPolicy in chat mode acts through http_actor(...), not generate(prompt ids)")
        renderer = self._need_renderer()
        chunks = [prompts[i : i + self.batch_size] for i in range(0, len(prompts), self.batch_size)]
        body = {"model": self.model, "logprobs": 0, "return_tokens_as_token_ids": True, "echo": False,
                "skip_special_tokens": True, "stop_token_ids": list(renderer.stop_ids), **self._sampling_fields(sampling)}

        def one(chunk: list[list[int]]) -> list[Generation]:
            answer = self._request("completions", {**body, "prompt": chunk})
            choices = [c for c in answer["choices"] if isinstance(c, dict)]
            choices.sort(key=lambda c: c.get("index", 0) if isinstance(c.get("index", 0), int) else 0)
            if len(choices) != len(chunk):
                raise AgentevoError(f"{self.base_url}/completions answered {len(choices)} choices for {len(chunk)} prompts")
            return [self._completion_generation(c) for c in choices]

        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, max(1, len(chunks)))) as ex:
            return [g for gens in ex.map(one, chunks) for g in gens]

    def _completion_generation(self, choice: dict[str, Any]) -> Generation:
        from agentevo.models.backend import Generation

        text = choice.get("text") or ""
        lp = choice.get("logprobs") or {}
        tokens, logprobs = lp.get("tokens") or [], lp.get("token_logprobs") or []
        ids = choice.get("token_ids")
        if ids is None and tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            ids = [int(t.split(":", 1)[1]) for t in tokens]
        if ids is None or len(logprobs) != len(ids) or any(x is None for x in logprobs):
            return self._text_only(text, choice.get("finish_reason"))
        return Generation([int(i) for i in ids], [float(x) for x in logprobs], text)

    def chat(self, conversations: list[list[dict[str, str]]], sampling: Sampling) -> list[Generation]:
        """Replies to text conversations via /v1/chat/completions (one request each, sent concurrently)."""
        fields = self._sampling_fields(sampling, chat=True)

        def one(messages: list[dict[str, str]]) -> Generation:
            answer = self._request("chat/completions", {"model": self.model, "messages": messages, **fields})
            return self._text_only(*self._chat_reply(answer))

        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, max(1, len(conversations)))) as ex:
            return list(ex.map(one, conversations))

    def complete(self, prompt_text: str, sampling: Sampling | None = None, system: str | None = None) -> str:
        """Text in, text out (one user turn through chat completions): RSD's writers and rule proposer."""
        from agentevo.models.backend import Sampling

        sampling = sampling or Sampling(temperature=0.0, max_new_tokens=512)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt_text}]
        fields = self._sampling_fields(sampling, chat=True)
        answer = self._request("chat/completions", {"model": self.model, "messages": messages, **fields})
        return self._chat_reply(answer)[0]


class HTTPChatActor:
    """Acts through an HTTPPolicy in chat mode: the same ReAct messages as PolicyActor, sent as text."""

    def __init__(self, policy: HTTPPolicy, instruction: str, window: int, sampling: Sampling, source: str = "self") -> None:
        self.policy, self.instruction, self.window, self.sampling = policy, instruction, window, sampling
        self.policy_id, self.source = policy.policy_id, source
        self._calls = 0

    def messages(self, ep: Any) -> list[dict[str, str]]:
        """The episode's next prompt as chat messages; past replies are their stored text."""
        msgs = build_messages(self.instruction, ep.goal, ep.first_obs, ep.history, self.window, prefix=ep.request.prefix)
        n_replies = sum(m.role == "assistant" for m in msgs)
        texts = iter([s.action_text for s in ep.steps[len(ep.steps) - n_replies :]] if n_replies else [])
        return [{"role": m.role, "content": next(texts) if m.role == "assistant" else m.text} for m in msgs]

    def act(self, episodes: list[Any]) -> list[Generation]:

        sampling = self.sampling
        if sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=sampling.seed + self._calls)
        self._calls += 1
        return self.policy.chat([self.messages(ep) for ep in episodes], sampling)

    def needs_plan(self) -> bool:
        return False


def http_actor(policy: HTTPPolicy, instruction: str, window: int, sampling: Sampling, source: str = "self") -> Any:
    """The actor for an HTTP policy: PolicyActor on token ids (completions mode) or HTTPChatActor (chat mode)."""
    if policy.mode == "chat":
        return HTTPChatActor(policy, instruction, window, sampling, source)
    from agentevo.rollout.engine import PolicyActor

    return PolicyActor(policy, instruction, window, sampling, source)
