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

Two engines: `generate_slots` (SlotKVCache, the default) keeps each sequence in a persistent row and extends it in
place; `generate_cached` (PrefixKVCache) rebuilds a padded cache per call and is kept for models whose attention
takes no prepared 4-D mask, and for bench/bench_generate.py. On the CPU the slot engine's decode steps read the
prefix every row of a call shares (an instruction) once per step, not once per row (`shared_prefix_attention`).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

try:  # transformers >= 4.56 composes caches from per-layer objects; older versions use transformers' generate
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError:  # pragma: no cover - depends on the installed transformers
    Cache, DynamicLayer = None, object
try:
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError:  # pragma: no cover - depends on the installed transformers
    AttentionInterface = ALL_ATTENTION_FUNCTIONS = None

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


def _shared_tokens(prompts: list[torch.Tensor]) -> int:
    """Length of the longest prefix all prompts share."""
    return min((_common_prefix(prompts[0], p) for p in prompts[1:]), default=len(prompts[0]))


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
    shared = min(_shared_tokens(prompts), min(len(p) for p in prompts) - 1)  # each prompt keeps one token to run
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


# -- persistent per-episode KV rows -----------------------------------------------------------------------------
#
# The path above rebuilds a left-padded cache from kept entries at every call and copies every finished row out of
# it (and, mid-call, the rows still running). Here each sequence owns a row ("slot") of per-layer buffers
# [slots, kv_heads, width, head_dim] that lives across calls: an episode's next prompt continues in the row that
# holds its history, new keys/values are written in place at each row's own length, rows of different lengths share
# one forward through a 4-D attention mask (column c of row b is visible while c <= that row's last position), and a
# row that has finished is retired by masking (it writes to a scratch column and sees column 0 only). Nothing is
# copied per step; a call copies keys/values only to fork a prefix two prompts share or to pack its rows together.

SLOT_ATTENTION = ("sdpa", "eager")  # implementations that take a prepared 4-D mask as is


def supports_slot_cache(model: Any) -> bool:
    """True when the slot path can run the model: full attention only, and sdpa or eager attention."""
    if not supports_prefix_cache(model):
        return False
    text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return getattr(text, "_attn_implementation", None) in SLOT_ATTENTION


def _weights_fingerprint(model: Any) -> tuple[int, int, float]:
    """Version counters, addresses and a strided value sample of the parameters (see PrefixKVCache)."""
    params = list(model.parameters())
    sums = [p.detach().reshape(-1)[:: max(1, p.numel() // 64)].double().sum() for p in params]
    sample = float(torch.stack(sums).sum()) if sums else 0.0  # one device sync, not one per parameter
    return (sum(p._version for p in params), sum(p.data_ptr() for p in params), sample)


class _SlotLayer(DynamicLayer):  # type: ignore[misc,valid-type]
    """One layer's view of the slot buffers for the rows of one forward: writes each row's new keys/values at the
    columns the driver set (cache.write_index) and returns the first cache.width columns of those rows."""

    is_croppable = False

    def __init__(self, owner: SlotKVCache, layer: int) -> None:
        super().__init__()
        self.owner, self.layer = owner, layer
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[Any, Any]:
        o = self.owner
        keys, values = o.keys[self.layer][o.lo : o.hi], o.values[self.layer][o.lo : o.hi]
        # index_put_, not scatter_: scatter_ into bf16 takes a slow path on the CPU (~10,000x here)
        keys.index_put_(o.write_index, key_states.to(keys.dtype))
        values.index_put_(o.write_index, value_states.to(values.dtype))
        return keys[:, :, : o.width], values[:, :, : o.width]

    def get_seq_length(self) -> int:
        return self.owner.width

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width, 0


class SlotKVCache:
    """Keys/values of recent sequences in persistent rows, found by longest common prefix and extended in place;
    bounded by a count of rows and by bytes; cleared when the weights change."""

    def __init__(self, model: Any, capacity: int = 64, max_bytes: int = 4 << 30) -> None:
        self.model = model
        self.capacity, self.max_bytes = capacity, max_bytes
        self.keys: list[torch.Tensor] = []  # per layer [rows, kv_heads, width, head_dim]; the last column is scratch
        self.values: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []  # per row: the token ids whose keys/values fill its first columns
        self.stamp: list[int] = []  # last call that used the row (least recently used rows are reused first)
        self.calls = 0
        self.hits = 0  # prompt tokens served from the cache
        self.misses = 0  # prompt tokens run through the model
        self.copied = 0  # token positions copied between rows (forks, packing)
        self.shared_steps = 0  # decode steps that read the rows' shared prefix once (shared_prefix_attention)
        self._fingerprint = _weights_fingerprint(model)
        # set by the driver for each forward
        self.lo = self.hi = self.width = 0
        self.write_index: tuple[torch.Tensor, ...] = ()  # (row [b,1,1], head [1,h,1], column [b,1,q]) per forward

    @property
    def rows(self) -> int:
        return len(self.tokens)

    @property
    def columns(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values, strict=True))

    def check_weights(self) -> None:
        """Forget every row if any parameter was modified or replaced since the last check."""
        now = _weights_fingerprint(self.model)
        if now != self._fingerprint:
            self.clear()
            self._fingerprint = now

    def clear(self) -> None:
        """Forget every row's contents (the buffers stay allocated)."""
        self.tokens = [self.tokens[0][:0]] * self.rows if self.rows else []

    def release(self) -> None:
        """Forget every row and free the buffers."""
        self.keys, self.values, self.tokens, self.stamp = [], [], [], []

    def lookup(self, prompt: torch.Tensor) -> list[tuple[int, int]]:
        """(common prefix length, row) for every row sharing a prefix with prompt, longest first."""
        found = []
        for row, tokens in enumerate(self.tokens):
            if len(tokens) and len(prompt) and int(tokens[0]) == int(prompt[0]):
                found.append((_common_prefix(tokens, prompt), row))
        return sorted(found, key=lambda f: (-f[0], f[1]))

    def reserve(self, rows: int, columns: int, like: torch.Tensor, layers: int, heads: int, dim: int,
                extra: int = 0) -> None:
        """Grow the buffers to at least `rows` rows (and up to `extra` more within capacity and max_bytes) and
        `columns` columns (+1 scratch) of like's dtype and device, keeping what they hold."""
        if self.keys and (self.keys[0].dtype != like.dtype or self.keys[0].device != like.device):
            self.release()  # compute dtype or device changed (autocast on/off): nothing kept is usable
        have_rows, have_cols = self.rows, self.columns
        cols = max(have_cols, columns + 1)
        if cols > have_cols:
            cols = max(cols, min(2 * have_cols, cols + 1024))  # amortise growth
        per_row = 2 * layers * heads * cols * dim * like.element_size()
        limit = max(rows, min(self.capacity, self.max_bytes // max(per_row, 1)))
        want = max(rows, min(have_rows + extra, limit))
        if want == have_rows and cols == have_cols:
            return
        new_k, new_v = [], []
        for layer in range(layers):
            k = like.new_zeros((want, heads, cols, dim))
            v = like.new_zeros((want, heads, cols, dim))
            if self.keys:
                keep, used = min(want, have_rows), min(have_cols, cols)
                k[:keep, :, :used] = self.keys[layer][:keep, :, :used]
                v[:keep, :, :used] = self.values[layer][:keep, :, :used]
            new_k.append(k)
            new_v.append(v)
        self.keys, self.values = new_k, new_v
        empty = torch.zeros(0, dtype=torch.long)
        self.tokens = (self.tokens + [empty] * want)[:want]
        self.stamp = (self.stamp + [-1] * want)[:want]

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` columns of row src into row dst (dst then holds src's first length tokens)."""
        for k, v in zip(self.keys, self.values, strict=True):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]
        self.tokens[dst] = self.tokens[src][:length]
        self.copied += length

    def swap_rows(self, a: int, b: int) -> None:
        """Exchange two rows' contents (to pack a call's rows together)."""
        length = max(len(self.tokens[a]), len(self.tokens[b]))
        if length:
            for k, v in zip(self.keys, self.values, strict=True):
                k[[a, b], :, :length] = k[[b, a], :, :length]
                v[[a, b], :, :length] = v[[b, a], :, :length]
        self.tokens[a], self.tokens[b] = self.tokens[b], self.tokens[a]
        self.stamp[a], self.stamp[b] = self.stamp[b], self.stamp[a]
        self.copied += len(self.tokens[a]) + len(self.tokens[b])


def _kv_shape(model: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of the model."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, heads, dim


def _compute_dtype(model: Any, device: torch.device) -> torch.dtype:
    """The dtype keys/values come out in: the autocast dtype when autocast is on, else the weights' dtype."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return next(model.parameters()).dtype


def _assign_rows(cache: SlotKVCache, prompts: list[torch.Tensor], dims: tuple[int, int, int]) -> tuple[list[int],
                                                                                             list[int]]:
    """A row and a reused prefix length per prompt. A prompt continues in the row holding its longest cached
    prefix; a prompt whose row another prompt of the call took gets a free row with that prefix copied in (a fork);
    the rows grow (within capacity and bytes) before a kept sequence is evicted."""
    n = len(prompts)
    matches = [cache.lookup(p) for p in prompts]
    rows: list[int] = [-1] * n
    reuse = [0] * n
    taken: set[int] = set()
    for i in sorted(range(n), key=lambda i: -(matches[i][0][0] if matches[i] else 0)):  # longest matches first
        for lcp, row in matches[i]:
            if row not in taken:
                rows[i], reuse[i] = row, min(lcp, len(prompts[i]) - 1)
                taken.add(row)
                break
    unassigned = [i for i in range(n) if rows[i] < 0]
    empty = sum(1 for r in range(cache.rows) if r not in taken and not len(cache.tokens[r]))
    if len(unassigned) > empty:
        cache.reserve(cache.rows, 0, cache.keys[0], *dims, extra=len(unassigned) - empty)
    claimed = [r for r in rows if r >= 0]
    lo, hi = (min(claimed), max(claimed) + 1) if claimed else (0, cache.rows)
    free = sorted((r for r in range(cache.rows) if r not in taken),  # near the call's rows, empty, then LRU
                  key=lambda r: (not lo <= r < hi, len(cache.tokens[r]) > 0, cache.stamp[r], r))
    if len(free) < len(unassigned):
        cache.reserve(cache.rows + len(unassigned) - len(free), 0, cache.keys[0], *dims)
        free += [r for r in range(cache.rows) if r not in taken and r not in free]
    for i, row in zip(unassigned, free, strict=False):
        rows[i] = row
        taken.add(row)
        # the best source now (an earlier fork may have rewritten a row), or what the free row itself holds
        best = next(iter(cache.lookup(prompts[i])), (0, row))
        reuse[i] = min(best[0], len(prompts[i]) - 1)
        if reuse[i] > 0 and best[1] != row:
            cache.copy_row(best[1], row, reuse[i])
    return rows, reuse


def _pack_rows(cache: SlotKVCache, rows: list[int]) -> list[int]:
    """Move the call's rows into one block of len(rows) rows when they are spread much wider (swaps rows: a
    per-call copy, never a per-step one); returns the rows' new indices."""
    n = len(rows)
    lo, hi = min(rows), max(rows) + 1
    if hi - lo <= n + max(1, n // 4):
        return rows
    starts = sorted({min(max(r, 0), cache.rows - n) for r in rows})
    start = max(starts, key=lambda s: sum(s <= r < s + n for r in rows))
    inside = {r for r in rows if start <= r < start + n}
    holes = iter(r for r in range(start, start + n) if r not in inside)
    moved = {}
    for r in rows:
        if r not in inside:
            hole = next(holes)
            cache.swap_rows(r, hole)
            moved[r] = hole
    return [moved.get(r, r) for r in rows]


def _mask(limits: torch.Tensor, width: int, q: int, float_mask: bool, dtype: torch.dtype) -> torch.Tensor:
    """[rows, 1, q, width] attention mask: query j of row b sees columns <= limits[b, j]."""
    cols = torch.arange(width, device=limits.device)
    visible = (cols.view(1, 1, -1) <= limits.view(limits.shape[0], q, 1)).unsqueeze(1)
    if not float_mask:
        return visible
    return torch.zeros(visible.shape, dtype=dtype, device=limits.device).masked_fill_(~visible, torch.finfo(dtype).min)


CASCADE_MIN = 64  # shared columns below which decode attention reads every row's own copy
_CASCADE_NAME = "agentevo_shared_prefix"
# (row of the batch whose first `columns` keys/values every row shares, columns, the model's own implementation)
_cascade_state: contextvars.ContextVar[tuple[int, int, str] | None] = contextvars.ContextVar(
    "agentevo_shared_prefix", default=None)


def shared_prefix_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Decode attention that reads the columns all rows share (the instruction every episode starts with) once
    for the whole batch, as one matrix product, instead of once per row ("cascade" attention); the rest of each
    row as usual. Scores of both parts go through one softmax, so the result is attention over the full row.
    Falls back to the model's own implementation for prefill (more than one query) or without a shared prefix."""
    state = _cascade_state.get()
    if state is None or query.shape[2] != 1 or not 0 < state[1] < key.shape[2]:
        own = state[2] if state else "sdpa"
        fallback = ALL_ATTENTION_FUNCTIONS[own] if own != "eager" else _eager_attention(module)
        return fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    ref, cols, _ = state
    rows, q_heads, _, dim = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    q = query.reshape(rows, kv_heads, group, dim)
    q_shared = q.permute(1, 0, 2, 3).reshape(kv_heads, rows * group, dim)  # every row's queries against one copy
    shared = torch.bmm(q_shared, key[ref, :, :cols].transpose(1, 2))
    shared = shared.view(kv_heads, rows, group, cols).permute(1, 0, 2, 3)
    own_part = torch.matmul(q, key[:, :, cols:].transpose(-1, -2))
    scores = torch.cat([shared, own_part], dim=-1).float().mul_(scaling if scaling is not None else dim ** -0.5)
    if attention_mask is not None:  # [rows, 1, 1, width]: additive (the driver's), or bool (True = visible)
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill_(~attention_mask, float("-inf"))
        else:
            scores = scores.add_(attention_mask)
    probs = scores.softmax(dim=-1).to(value.dtype)
    p_shared = probs[..., :cols].permute(1, 0, 2, 3).reshape(kv_heads, rows * group, cols)
    out = torch.bmm(p_shared, value[ref, :, :cols]).view(kv_heads, rows, group, dim).permute(1, 0, 2, 3)
    out = out + torch.matmul(probs[..., cols:], value[:, :, cols:])
    return out.reshape(rows, q_heads, 1, dim).transpose(1, 2).contiguous(), None


def _eager_attention(module: Any) -> Any:
    """The eager attention function of the module's modeling file (each architecture defines its own)."""
    return inspect.getmodule(type(module)).eager_attention_forward  # type: ignore[union-attr]


if AttentionInterface is not None:
    AttentionInterface.register(_CASCADE_NAME, shared_prefix_attention)


@contextlib.contextmanager
def _shared_prefix(model: Any, ref: int, cols: int) -> Iterator[None]:
    """Route the model's attention through shared_prefix_attention for the forwards inside (restored after)."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    own = config._attn_implementation
    token = _cascade_state.set((ref, cols, own))
    config._attn_implementation_internal = _CASCADE_NAME
    try:
        yield
    finally:
        config._attn_implementation_internal = own
        _cascade_state.reset(token)


def _shared_columns(cache: SlotKVCache, rows: list[int], prompts: list[torch.Tensor]) -> int:
    """Leading columns whose keys/values are bit-identical in every row of the call (0 below CASCADE_MIN): the
    common token prefix of the prompts when the rows hold one copy of it (forked from one prefill), else 0."""
    if len(rows) < 2:
        return 0
    cols = _shared_tokens(prompts)
    if cols < CASCADE_MIN:
        return 0
    ref = rows[0]
    for k, v in zip(cache.keys, cache.values, strict=True):
        for r in rows[1:]:
            if not (torch.equal(k[r, :, :cols], k[ref, :, :cols]) and torch.equal(v[r, :, :cols], v[ref, :, :cols])):
                return 0
    return cols


def cascade_default(device: torch.device) -> bool:
    """Shared-prefix attention where it was measured to pay: the CPU (bench/bench_generate.py)."""
    return device.type == "cpu" and AttentionInterface is not None


@torch.no_grad()
def generate_slots(
    model: Any,
    cache: SlotKVCache,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    stop_ids: list[int],
    pad_id: int,
    shared_prefix: bool | None = None,
) -> list[tuple[list[int], list[float]]]:
    """(token ids, raw log-probs) per prompt, each prompt continuing in the cache row that holds its history.
    shared_prefix: decode attention reads the columns all rows share once per step (None: on the CPU only)."""
    cache.check_weights()
    cache.calls += 1
    device = next(model.parameters()).device
    n_layers, heads, dim = _kv_shape(model)
    dtype = _compute_dtype(model, device)
    prompt_t = [torch.tensor(p, dtype=torch.long) for p in prompts]
    n = len(prompts)
    longest = max(len(p) for p in prompts) + max_new_tokens
    dims = (n_layers, heads, dim)
    cache.reserve(n, longest, torch.empty(0, dtype=dtype, device=device), *dims)
    _prefill_shared_rows(model, cache, prompt_t, dims, dtype, device)
    rows, reuse = _assign_rows(cache, prompt_t, dims)
    for i, (row, r) in enumerate(zip(rows, reuse, strict=True)):
        cache.tokens[row] = prompt_t[i][:r]  # columns past r are about to be overwritten
        cache.stamp[row] = cache.calls
        cache.hits += r
        cache.misses += len(prompt_t[i]) - r
    rows = _pack_rows(cache, rows)
    lo, hi = min(rows), max(rows) + 1
    span = hi - lo
    scratch = cache.columns - 1
    float_mask = getattr(model.config, "_attn_implementation", "sdpa") == "eager"
    cols = 0  # columns every row shares, read once per decode step (set after the prefill)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(base.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    cache_obj = Cache(layers=[_SlotLayer(cache, layer) for layer in range(n_layers)])
    heads_index = torch.arange(heads, device=device).view(1, -1, 1)

    def forward(ids: torch.Tensor, write: torch.Tensor, limits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cache.lo, cache.hi = lo, hi
        cache.width = int(limits.max()) + 1
        cache.write_index = (torch.arange(write.shape[0], device=device).view(-1, 1, 1), heads_index,
                             write.view(write.shape[0], 1, -1))
        mask = _mask(limits, cache.width, ids.shape[1], float_mask or bool(cols), dtype)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    **{cache_kw: cache_obj}, **extra)
        return out.logits[:, -1, :].float()

    # prefill: each row's new tokens, left-padded, land at columns reuse .. len(prompt)-1 of its row; the rows of the
    # span that belong to no prompt (or the padding) write to the scratch column and see column 0 only
    suffix = max(len(p) - r for p, r in zip(prompt_t, reuse, strict=True))
    ids = torch.full((span, suffix), pad_id, dtype=torch.long)
    write = torch.full((span, suffix), scratch, dtype=torch.long)
    limits = torch.zeros((span, suffix), dtype=torch.long)
    owner: list[int | None] = [None] * span
    for i, (row, r) in enumerate(zip(rows, reuse, strict=True)):
        b, new = row - lo, prompt_t[i][r:]
        ids[b, suffix - len(new) :] = new
        write[b, suffix - len(new) :] = torch.arange(r, len(prompt_t[i]))
        owner[b] = i
    limits = torch.where(write == scratch, 0, write)
    logits = forward(ids.to(device), write.to(device), limits.to(device), limits.to(device))

    if shared_prefix is None:
        shared_prefix = cascade_default(device)
    cols = _shared_columns(cache, rows, prompt_t) if shared_prefix else 0
    # every forward from here on decodes one token per row
    decode_attention = _shared_prefix(model, rows[0] - lo, cols) if cols else contextlib.nullcontext()

    # random draws in prompt order, so a prompt's sample does not depend on which cache row it landed in
    batch_rows = torch.tensor([r - lo for r in rows], device=device)
    in_prompt_order = span == n and rows == list(range(lo, hi))

    def pick(logits: torch.Tensor) -> torch.Tensor:
        if in_prompt_order or temperature <= 0.0:
            return _pick(logits, temperature, top_p, top_k)
        tokens = torch.zeros(span, dtype=torch.long, device=device)  # rows of no prompt feed token 0 (masked)
        tokens[batch_rows] = _pick(logits[batch_rows], temperature, top_p, top_k)
        return tokens

    stops = torch.tensor(stop_ids, device=device)
    end = torch.zeros(span, dtype=torch.long)  # next column (= position) of each live row
    for b, i in enumerate(owner):
        if i is not None:
            end[b] = len(prompt_t[i])
    end = end.to(device)
    live = torch.tensor([i is not None for i in owner], device=device)
    generated: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    left = sum(i is not None for i in owner)
    with decode_attention:
        for step in range(max_new_tokens):
            tokens = pick(logits)
            token_logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            finished = torch.isin(tokens, stops) | (step + 1 >= max_new_tokens)
            # one device-to-host transfer per step (float64 holds token ids and float32 log-probs exactly)
            token_list, logp_list, finished_list = torch.stack(
                [tokens.double(), token_logp.double(), finished.double()]).tolist()
            for b, i in enumerate(owner):
                if i is None:
                    continue
                generated[i].append(int(token_list[b]))
                logprobs[i].append(logp_list[b])
                if finished_list[b]:
                    # the row's columns hold the prompt and the generated tokens but the last (it was never fed in)
                    cache.tokens[rows[i]] = torch.cat([prompt_t[i], torch.tensor(generated[i][:-1], dtype=torch.long)])
                    owner[b] = None
                    left -= 1
            if left == 0:
                break
            live = live & ~finished  # a finished row is retired by masking: scratch writes, column 0 only
            write = torch.where(live, end, scratch)
            limits = torch.where(live, end, 0)
            logits = forward(tokens.unsqueeze(-1), write, limits, limits.unsqueeze(-1))
            cache.shared_steps += bool(cols)
            end = end + 1
    return list(zip(generated, logprobs, strict=True))


@torch.no_grad()
def _prefill_shared_rows(model: Any, cache: SlotKVCache, prompts: list[torch.Tensor], dims: tuple[int, int, int],
                         dtype: torch.dtype, device: torch.device) -> None:
    """Run the prefix all prompts share (an instruction, a goal) once into a free row, so a batch of fresh episodes
    forks it instead of computing it once per row."""
    if len(prompts) < 2:
        return
    shared = min(_shared_tokens(prompts), min(len(p) for p in prompts) - 1)  # each prompt keeps one token to run
    found = cache.lookup(prompts[0][:shared]) if shared > 0 else []
    if shared - (found[0][0] if found else 0) < SHARED_PREFIX_MIN:
        return
    row = min(range(cache.rows), key=lambda r: (len(cache.tokens[r]) > 0, cache.stamp[r], r))
    tokens = prompts[0][:shared]
    cache.tokens[row] = tokens[:0]
    cache.lo, cache.hi, cache.width = row, row + 1, shared
    cache.write_index = (torch.zeros((1, 1, 1), dtype=torch.long, device=device),
                         torch.arange(dims[1], device=device).view(1, -1, 1),
                         torch.arange(shared, device=device).view(1, 1, -1))
    float_mask = getattr(model.config, "_attn_implementation", "sdpa") == "eager"
    mask = _mask(torch.arange(shared, device=device).view(1, -1), shared, shared, float_mask, dtype)
    cache_obj = Cache(layers=[_SlotLayer(cache, layer) for layer in range(dims[0])])
    _forward(model, tokens.unsqueeze(0).to(device), mask, torch.arange(shared, device=device).unsqueeze(0), cache_obj)
    cache.tokens[row] = tokens
    cache.stamp[row] = cache.calls
    cache.misses += shared

