"""Generation that reuses each episode's KV cache across turns.

An agent's prompt at turn t is its prompt at turn t-1, the reply it generated, and the new observation: almost all
of it was already run through the model one turn earlier. Re-running that prefix every turn made prefill dominate
CPU rollouts. Here the keys/values of every finished reply (prompt + generated tokens) are kept, and a new prompt
only runs the tokens after its longest common prefix with a kept entry (a sliding history window still reuses the
instruction and goal). Rows of a batch may have different cached lengths: each row is laid out as
[left pad][cached prefix][pad][new tokens] with an attention mask and explicit position ids, so one forward pass
serves the whole batch; finished rows leave it once half of the batch has stopped. The cache is bounded by a
count of sequences and by bytes (keys/values of an 8B model take about 0.3 MB per token in fp32).

Entries are dropped whenever the model's weights change (parameter version counters move on every in-place
update: optimizer steps, load_state_dict), so a trained policy never reads keys/values of its former self.
Only models whose every layer is full attention are supported; others use transformers' generate.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

try:  # transformers >= 4.56 composes caches from per-layer objects; older versions use transformers' generate
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError:  # pragma: no cover - depends on the installed transformers
    Cache, DynamicLayer = None, object

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values shaped [heads, length, head_dim]


def supports_prefix_cache(model: Any) -> bool:
    """True for decoder-only models whose layers are all full attention (no sliding window or hybrid layers)."""
    config = getattr(model, "config", None)
    if Cache is None or config is None or getattr(config, "is_encoder_decoder", False):
        return False
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return False
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return False
    return True


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D token tensors."""
    n = min(len(a), len(b))
    same = a[:n] == b[:n]
    return n if bool(same.all()) else int((~same).int().argmax())


@dataclass
class _Entry:
    tokens: torch.Tensor  # 1-D token ids whose keys/values are in kv
    kv: KV

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv)


class PrefixKVCache:
    """Keys/values of recent sequences, found by longest common prefix; cleared when the weights change."""

    def __init__(self, model: Any, capacity: int = 64, max_bytes: int = 4 << 30) -> None:
        self.model = model
        self.capacity, self.max_bytes = capacity, max_bytes
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.bytes = 0
        self._next = 0
        self._fingerprint = self._weights_fingerprint()
        self.hits = 0  # prompt tokens served from the cache
        self.misses = 0  # prompt tokens run through the model

    def _weights_fingerprint(self) -> tuple[int, int, float]:
        """Version counters and addresses of the parameters, and a strided sample of their values (edits made
        through `.data` skip the version counter)."""
        params = list(self.model.parameters())
        sample = sum(float(p.detach().reshape(-1)[:: max(1, p.numel() // 64)].double().sum()) for p in params)
        return (sum(p._version for p in params), sum(p.data_ptr() for p in params), sample)

    def check_weights(self) -> None:
        """Drop every entry if any parameter was modified or replaced since the last check."""
        now = self._weights_fingerprint()
        if now != self._fingerprint:
            self.clear()
            self._fingerprint = now

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def lookup(self, prompt: torch.Tensor) -> tuple[int, int | None]:
        """(length of the longest cached prefix of prompt, the entry holding it); (0, None) when nothing matches."""
        best, best_key = 0, None
        for key, entry in self.entries.items():
            if min(len(entry.tokens), len(prompt)) <= best:
                continue
            lcp = _common_prefix(entry.tokens, prompt)
            if lcp > best:
                best, best_key = lcp, key
        if best_key is not None:
            self.entries.move_to_end(best_key)
        return best, best_key

    def prefix(self, key: int, length: int) -> KV:
        return [(k[:, :length], v[:, :length]) for k, v in self.entries[key].kv]

    def store(self, tokens: torch.Tensor, kv: KV, replaces: int | None) -> None:
        """Keep kv for tokens; the entry it grew from is dropped when it is a prefix of tokens."""
        if replaces is not None and replaces in self.entries:
            old = self.entries[replaces].tokens
            if len(old) <= len(tokens) and bool((tokens[: len(old)] == old).all()):
                self.bytes -= self.entries.pop(replaces).nbytes
        entry = _Entry(tokens, kv)
        self.entries[self._next] = entry
        self.bytes += entry.nbytes
        self._next += 1
        while self.entries and (len(self.entries) > self.capacity or self.bytes > self.max_bytes):
            self.bytes -= self.entries.popitem(last=False)[1].nbytes


def _forward(model: Any, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> Any:
    """model(...) with the cache under the keyword this transformers version uses; logits of the last position only."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps forward(**kwargs)
    params = inspect.signature(base.forward).parameters
    kwargs: dict[str, Any] = {"cache" if "cache" in params else "past_key_values": cache}
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs)


class _BufferedLayer(DynamicLayer):  # type: ignore[misc,valid-type]
    """One layer's keys/values in buffers allocated once per batch and written in place (transformers'
    DynamicLayer concatenates, copying the whole cache at every generated token)."""

    is_croppable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.buf_keys, self.buf_values, self.length = keys, values, length
        self.device, self.dtype = keys.device, keys.dtype
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self.buf_keys[:, :, : self.length]
        self.values = self.buf_values[:, :, : self.length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        end = self.length + key_states.shape[-2]
        self.buf_keys[:, :, self.length : end] = key_states
        self.buf_values[:, :, self.length : end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def select_rows(self, rows: torch.Tensor) -> None:
        self.buf_keys = self.buf_keys.index_select(0, rows)
        self.buf_values = self.buf_values.index_select(0, rows)
        self._views()


def _kv_templates(model: Any) -> KV:
    """Zero-length per-layer keys/values [kv_heads, 0, head_dim] of the model (the layout of an empty prefix)."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    empty = next(model.parameters()).new_zeros((heads, 0, dim))
    return [(empty, empty)] * config.num_hidden_layers


def _buffered_cache(rows: list[KV], width: int, room: int, templates: KV) -> tuple[Any, list[_BufferedLayer]]:
    """A cache holding the rows' prefixes left-padded to width, with room for `room` more positions."""
    layers = []
    for layer, (k0, v0) in enumerate(templates):
        keys = k0.new_zeros((len(rows), k0.shape[0], width + room, k0.shape[-1]))
        values = v0.new_zeros((len(rows), v0.shape[0], width + room, v0.shape[-1]))
        for b, row in enumerate(rows):
            if row:
                k, v = row[layer]
                keys[b, :, width - k.shape[1] : width] = k
                values[b, :, width - v.shape[1] : width] = v
        layers.append(_BufferedLayer(keys, values, width))
    return Cache(layers=layers), layers


def _pick(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """Next tokens from last-position logits: argmax when greedy, else temperature / top-k / nucleus sampling."""
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    scaled = logits / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1).squeeze(-1)


SHARED_PREFIX_MIN = 32  # tokens a shared prefix must add over what is cached before it is run once for all rows


@torch.no_grad()
def _prefill_shared_prefix(model: Any, cache: PrefixKVCache, prompts: list[torch.Tensor]) -> None:
    """Run the prefix all prompts share (an instruction, a goal) once and cache it, so a batch of fresh episodes
    does not compute it once per row."""
    if len(prompts) < 2:
        return
    shared = len(prompts[0]) - 1
    for p in prompts[1:]:
        shared = min(shared, _common_prefix(prompts[0], p), len(p) - 1)
    cached, _ = cache.lookup(prompts[0][:shared]) if shared > 0 else (0, None)
    if shared - cached < SHARED_PREFIX_MIN:
        return
    tokens = prompts[0][:shared]
    device = next(model.parameters()).device
    ids = tokens.unsqueeze(0).to(device)
    layers = [_BufferedLayer(k.new_zeros((1, k.shape[0], shared, k.shape[-1])),
                             v.new_zeros((1, v.shape[0], shared, v.shape[-1])), 0) for k, v in _kv_templates(model)]
    _forward(model, ids, torch.ones_like(ids), torch.arange(shared, device=device).unsqueeze(0), Cache(layers=layers))
    cache.store(tokens, [(layer.buf_keys[0], layer.buf_values[0]) for layer in layers], None)
    cache.misses += shared


@torch.no_grad()
def generate_cached(
    model: Any,
    cache: PrefixKVCache,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    stop_ids: list[int],
    pad_id: int,
) -> list[tuple[list[int], list[float]]]:
    """(token ids, raw log-probs) per prompt; every finished sequence's keys/values go into the cache."""
    cache.check_weights()
    device = next(model.parameters()).device
    prompt_t = [torch.tensor(p, dtype=torch.long) for p in prompts]
    _prefill_shared_prefix(model, cache, prompt_t)
    reuse: list[int] = []
    sources: list[int | None] = []
    past_rows: list[KV] = []
    for p in prompt_t:
        length, key = cache.lookup(p)
        length = min(length, len(p) - 1)  # at least one new token, so the last position yields the next logits
        reuse.append(length)
        sources.append(key if length > 0 else None)
        past_rows.append(cache.prefix(key, length) if key is not None and length > 0 else [])
        cache.hits += length
        cache.misses += len(p) - length
    n = len(prompts)
    width = max(reuse)
    suffix_width = max(len(p) - r for p, r in zip(prompt_t, reuse, strict=True))
    ids = torch.full((n, suffix_width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width + suffix_width), dtype=torch.long)
    positions = torch.zeros((n, suffix_width), dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_t, reuse, strict=True)):
        new = p[r:]
        ids[b, suffix_width - len(new) :] = new
        mask[b, width - r : width] = 1
        mask[b, width + suffix_width - len(new) :] = 1
        positions[b, suffix_width - len(new) :] = torch.arange(r, len(p))
    cache_obj, layers = _buffered_cache(past_rows, width, suffix_width + max_new_tokens, _kv_templates(model))
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    logits = _forward(model, ids, mask, positions, cache_obj).logits[:, -1, :].float()

    stops = torch.tensor(stop_ids, device=device)
    owner: list[int | None] = list(range(n))  # batch row -> prompt index; None once the row has finished
    next_pos = torch.tensor([len(p) for p in prompts], device=device)
    generated: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    for step in range(max_new_tokens):
        tokens = _pick(logits, temperature, top_p, top_k)
        token_logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        finished = (torch.isin(tokens, stops) | (step + 1 >= max_new_tokens)).tolist()
        token_list, logp_list = tokens.tolist(), token_logp.tolist()
        for b, i in enumerate(owner):
            if i is None:
                continue
            generated[i].append(token_list[b])
            logprobs[i].append(logp_list[b])
            if finished[b]:
                # Keys/values cover the prompt and the generated tokens but the last (it was never fed in).
                real = mask[b].bool()
                row_kv = [(layer.keys[b][:, real].clone(), layer.values[b][:, real].clone()) for layer in layers]
                tokens_seen = torch.cat([prompt_t[i], torch.tensor(generated[i][:-1], dtype=torch.long)])
                cache.store(tokens_seen, row_kv, sources[i])
                owner[b] = None
        live = [b for b, i in enumerate(owner) if i is not None]
        if not live:
            break
        if 2 * len(live) <= len(owner):  # finished rows keep computing until half the batch is done
            keep = torch.tensor(live, device=device)
            for layer in layers:
                layer.select_rows(keep)
            owner = [owner[b] for b in live]
            tokens, mask, next_pos = tokens[keep], mask[keep], next_pos[keep]
        mask = torch.cat([mask, mask.new_ones((len(owner), 1))], dim=1)
        logits = _forward(model, tokens.unsqueeze(-1), mask, next_pos.unsqueeze(-1), cache_obj).logits[:, -1, :]
        logits = logits.float()
        next_pos = next_pos + 1
    return list(zip(generated, logprobs, strict=True))
