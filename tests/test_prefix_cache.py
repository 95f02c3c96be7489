"""Generation with cross-turn KV reuse: same replies as transformers' generate, and never stale weights."""

from __future__ import annotations

import copy

import pytest
import torch

from agentevo.errors import ConfigError
from agentevo.models import prefix_cache as pc
from agentevo.models.backend import Sampling, TransformersPolicy
from agentevo.models.prefix_cache import PrefixKVCache, SlotKVCache, _pick, supports_prefix_cache


@pytest.fixture(params=["slots", "prefix"])
def pair(tiny_policy: TransformersPolicy, request) -> tuple[TransformersPolicy, TransformersPolicy]:  # noqa: ANN001
    """The same weights behind a cached (each KV engine) and an uncached policy."""
    model = copy.deepcopy(tiny_policy.model)
    cached = TransformersPolicy(model, tiny_policy.tokenizer, "cached", batch_size=4, prefix_cache=16,
                                kv_engine=request.param)
    plain = TransformersPolicy(model, tiny_policy.tokenizer, "plain", batch_size=4, prefix_cache=0)
    assert isinstance(cached.kv_cache, SlotKVCache if request.param == "slots" else PrefixKVCache)
    assert plain.kv_cache is None
    return cached, plain


def _kept(cache: PrefixKVCache | SlotKVCache) -> list[list[int]]:
    """The token sequences a cache holds keys/values for."""
    if isinstance(cache, SlotKVCache):
        return [t.tolist() for t in cache.tokens if len(t)]
    return [e.tokens.tolist() for e in cache.entries.values()]


def _episode_prompts(policy: TransformersPolicy, n: int) -> list[list[int]]:
    texts = ["You are in the kitchen.", "take knife open fridge", "Your task is to cook a meal. Check the cookbook."]
    return [policy.tokenizer.encode(texts[i % 3] * (1 + i), add_special_tokens=False) for i in range(n)]


def test_greedy_replies_match_generate_over_turns(pair) -> None:  # noqa: ANN001
    cached, plain = pair
    greedy = Sampling(temperature=0.0, max_new_tokens=6)
    prompts = _episode_prompts(cached, 5)
    observation = cached.tokenizer.encode(" Observation: You take the knife.", add_special_tokens=False)
    for turn in range(3):
        got, want = cached.generate(prompts, greedy), plain.generate(prompts, greedy)
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w.token_ids
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        if turn > 0:
            assert cached.kv_cache.hits > 0
        # the next prompt extends the previous one by the reply and an observation, as an agent's history does
        prompts = [p + g.token_ids + observation[: 2 + k] for k, (p, g) in enumerate(zip(prompts, got, strict=True))]
    # a sliding window keeps only the start of each prompt: the common prefix is still reused
    hits = cached.kv_cache.hits
    trimmed = [p[:5] + p[-7:] for p in prompts]
    for g, w in zip(cached.generate(trimmed, greedy), plain.generate(trimmed, greedy), strict=True):
        assert g.token_ids == w.token_ids
    assert cached.kv_cache.hits - hits == 5 * len(trimmed)


def test_finished_sequences_are_cached_and_replace_their_prefix(pair) -> None:  # noqa: ANN001
    cached, _ = pair
    prompt = _episode_prompts(cached, 1)[0]
    gen = cached.generate([prompt], Sampling(temperature=0.0, max_new_tokens=4))[0]
    assert _kept(cached.kv_cache) == [prompt + gen.token_ids[:-1]]  # the last token was never fed in
    if isinstance(cached.kv_cache, PrefixKVCache):
        assert next(iter(cached.kv_cache.entries.values())).kv[0][0].shape[1] == len(prompt) + len(gen.token_ids) - 1
    longer = prompt + gen.token_ids + prompt[:3]
    cached.generate([longer], Sampling(temperature=0.0, max_new_tokens=4))
    assert len(_kept(cached.kv_cache)) == 1  # the entry it grew from was dropped (extended in place)
    assert cached.kv_cache.hits == len(prompt) + len(gen.token_ids) - 1


def test_weight_changes_clear_the_cache(pair) -> None:  # noqa: ANN001
    cached, plain = pair
    greedy = Sampling(temperature=0.0, max_new_tokens=5)
    prompts = _episode_prompts(cached, 3)
    cached.generate(prompts, greedy)
    assert len(_kept(cached.kv_cache)) == 3
    optimizer = torch.optim.SGD(cached.model.parameters(), lr=0.5)
    loss = cached.model(input_ids=torch.tensor([prompts[0]]), labels=torch.tensor([prompts[0]])).loss
    loss.backward()
    optimizer.step()
    cached.kv_cache.check_weights()
    assert not _kept(cached.kv_cache)
    cached.generate(prompts, greedy)
    with torch.no_grad():  # an edit through .data does not move the version counter; the value sample sees it
        next(cached.model.parameters()).data.mul_(1.5)
    for g, w in zip(cached.generate(prompts, greedy), plain.generate(prompts, greedy), strict=True):
        assert g.token_ids == w.token_ids


def test_capacity_evicts_least_recently_used(tiny_policy: TransformersPolicy) -> None:
    cache = PrefixKVCache(tiny_policy.model, capacity=2)
    kv = [(torch.zeros(1, 3, 2), torch.zeros(1, 3, 2))]
    for k in range(3):
        cache.store(torch.tensor([k, 1, 2]), kv, None)
    assert [e.tokens[0].item() for e in cache.entries.values()] == [1, 2]
    assert cache.lookup(torch.tensor([1, 1, 9])) == (2, 1)
    assert cache.lookup(torch.tensor([7, 7])) == (0, None)


def test_sampling_helpers() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    torch.manual_seed(0)
    assert {int(_pick(logits, 5.0, 1.0, 1)) for _ in range(20)} == {1}  # top-1 is argmax even when hot
    assert {int(_pick(logits, 5.0, 1.0, 2)) for _ in range(200)} == {1, 3}
    assert {int(_pick(logits, 1.0, 0.5, 0)) for _ in range(100)} == {1}  # p(1) = 0.64 >= top_p alone
    assert int(_pick(logits, 0.0, 1.0, 0)) == 1


def test_sliding_window_models_fall_back_to_generate(tiny_policy: TransformersPolicy) -> None:
    config = copy.deepcopy(tiny_policy.model.config)
    model = type("M", (), {"config": config})()
    assert supports_prefix_cache(model)
    config.layer_types = ["sliding_attention", "full_attention"]
    assert not supports_prefix_cache(model)


def test_rows_that_stop_early_leave_the_batch_without_changing_the_others(pair) -> None:  # noqa: ANN001
    from agentevo.models.prefix_cache import generate_cached, generate_slots

    cached, _ = pair
    slots = isinstance(cached.kv_cache, SlotKVCache)
    run, make = (generate_slots, SlotKVCache) if slots else (generate_cached, PrefixKVCache)
    prompts = _episode_prompts(cached, 6)
    args = (0.0, 1.0, 0, )
    free = run(cached.model, make(cached.model), prompts, 10, *args, [-1], cached.pad_id)
    # stop at a token row 0 produces third: rows end at different steps (or run to the limit)
    stop = free[0][0][2]
    stopped = run(cached.model, make(cached.model), prompts, 10, *args, [stop], cached.pad_id)
    lengths = set()
    for (ids, logps), (want_ids, want_logps) in zip(stopped, free, strict=True):
        cut = want_ids.index(stop) + 1 if stop in want_ids else len(want_ids)
        assert ids == want_ids[:cut]
        assert logps == pytest.approx(want_logps[:cut], abs=1e-4)
        lengths.add(len(ids))
    assert len(lengths) > 1


def test_a_prefix_shared_by_fresh_episodes_runs_once(pair) -> None:  # noqa: ANN001
    cached, plain = pair
    shared = cached.tokenizer.encode("Your task is to cook a meal. Check the cookbook in the kitchen. " * 3,
                                     add_special_tokens=False)
    assert len(shared) > 40
    tails = ["take knife", "open fridge now", "You are in the kitchen."]
    prompts = [shared + cached.tokenizer.encode(t, add_special_tokens=False) for t in tails]
    greedy = Sampling(temperature=0.0, max_new_tokens=5)
    for g, w in zip(cached.generate(prompts, greedy), plain.generate(prompts, greedy), strict=True):
        assert g.token_ids == w.token_ids
    assert cached.kv_cache.misses == len(shared) + sum(len(p) - len(shared) for p in prompts)
    assert cached.kv_cache.hits == len(shared) * len(prompts)


def test_byte_budget_evicts_oldest(tiny_policy: TransformersPolicy) -> None:
    kv = [(torch.zeros(1, 3, 2), torch.zeros(1, 3, 2))]  # 2 x 6 floats = 48 bytes per entry
    cache = PrefixKVCache(tiny_policy.model, capacity=10, max_bytes=100)
    for k in range(3):
        cache.store(torch.tensor([k, 1, 2]), kv, None)
    assert [e.tokens[0].item() for e in cache.entries.values()] == [1, 2] and cache.bytes == 96
    cache.clear()
    assert cache.bytes == 0


# -- the slot engine: persistent rows extended in place ------------------------------------------------------------


def _slots(tiny_policy: TransformersPolicy, capacity: int = 16, batch_size: int = 8, attn: str | None = None
           ) -> tuple[TransformersPolicy, TransformersPolicy]:
    model = copy.deepcopy(tiny_policy.model)
    if attn is not None:
        model.config._attn_implementation = attn
    cached = TransformersPolicy(model, tiny_policy.tokenizer, "s", batch_size=batch_size, prefix_cache=capacity)
    return cached, TransformersPolicy(model, tiny_policy.tokenizer, "g", batch_size=batch_size, prefix_cache=0)


def test_slot_rows_continue_in_place_without_copies(tiny_policy: TransformersPolicy) -> None:
    cached, plain = _slots(tiny_policy)
    cache = cached.kv_cache
    assert isinstance(cache, SlotKVCache)
    greedy = Sampling(temperature=0.0, max_new_tokens=5)
    prompts = _episode_prompts(cached, 6)
    observation = cached.tokenizer.encode(" Observation: ok.", add_special_tokens=False)
    for turn in range(3):
        hits = cache.hits
        got = cached.generate(prompts, greedy)
        assert [g.token_ids for g in got] == [w.token_ids for w in plain.generate(prompts, greedy)]
        if turn > 0:  # every episode's history (all but its last reply token) came from its own row, uncopied
            assert cache.hits - hits == sum(len(p) - len(observation) - 1 for p in prompts)
        assert cache.copied == 0 and cache.rows == 6
        prompts = [p + g.token_ids + observation for p, g in zip(prompts, got, strict=True)]


def test_sampled_logprobs_are_the_models_own(tiny_policy: TransformersPolicy) -> None:
    """Behaviour log-probs of sampled tokens equal a plain forward's over prompt + reply (raw, untempered)."""
    cached, _ = _slots(tiny_policy)
    model = cached.model
    prompts = _episode_prompts(cached, 4)
    for turn, sampling in enumerate([Sampling(temperature=1.3, top_p=0.9, max_new_tokens=6, seed=3),
                                     Sampling(temperature=0.7, top_k=5, max_new_tokens=6, seed=4)]):
        gens = cached.generate(prompts, sampling)
        for p, g in zip(prompts, gens, strict=True):
            ids = torch.tensor([p + g.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            want = [float(logp[len(p) - 1 + j, tok]) for j, tok in enumerate(g.token_ids)]
            assert g.logprobs == pytest.approx(want, abs=1e-4), turn
        prompts = [p + g.token_ids + p[:3] for p, g in zip(prompts, gens, strict=True)]
    assert cached.kv_cache.hits > 0


def test_a_prompt_whose_row_is_taken_forks_a_copy(tiny_policy: TransformersPolicy) -> None:
    cached, plain = _slots(tiny_policy)
    greedy = Sampling(temperature=0.0, max_new_tokens=4)
    prompt = _episode_prompts(cached, 2)[1]
    first = cached.generate([prompt], greedy)[0]
    group = [prompt + first.token_ids + prompt[:2]] * 3  # a GRPO group: one history, three continuations
    got = cached.generate(group, greedy)
    assert [g.token_ids for g in got] == [w.token_ids for w in plain.generate(group, greedy)]
    kept = len(prompt) + len(first.token_ids) - 1
    assert cached.kv_cache.copied == 2 * kept  # one continues in place, two copy the history
    assert cached.kv_cache.hits == 3 * kept


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_slots_match_generate_with_more_prompts_than_capacity(tiny_policy: TransformersPolicy, attn: str) -> None:
    cached, plain = _slots(tiny_policy, capacity=2, batch_size=8, attn=attn)
    assert isinstance(cached.kv_cache, SlotKVCache)
    greedy = Sampling(temperature=0.0, max_new_tokens=5)
    prompts = _episode_prompts(cached, 5)
    for _ in range(2):
        got = cached.generate(prompts, greedy)
        assert [g.token_ids for g in got] == [w.token_ids for w in plain.generate(prompts, greedy)]
        prompts = [p + g.token_ids + p[:2] for p, g in zip(prompts, got, strict=True)]
    assert cached.kv_cache.rows == 5  # grown to the call's prompts, past capacity


def test_slot_engine_needs_a_mask_taking_attention(tiny_policy: TransformersPolicy) -> None:
    model = copy.deepcopy(tiny_policy.model)
    model.config._attn_implementation = "flex_attention"
    policy = TransformersPolicy(model, tiny_policy.tokenizer, "f", prefix_cache=4)
    assert isinstance(policy.kv_cache, PrefixKVCache)
    with pytest.raises(ConfigError, match="kv_engine must be 'slots' or 'prefix' \\(got 'fast'\\)"):
        TransformersPolicy(model, tiny_policy.tokenizer, "f", kv_engine="fast")


def test_slots_under_bf16_autocast_keep_bf16_rows(tiny_policy: TransformersPolicy) -> None:
    cached, _ = _slots(tiny_policy)
    prompts = _episode_prompts(cached, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gens = cached.generate(prompts, Sampling(temperature=0.0, max_new_tokens=4))
        again = cached.generate([p + g.token_ids for p, g in zip(prompts, gens, strict=True)],
                                Sampling(temperature=0.0, max_new_tokens=4))
    assert cached.kv_cache.keys[0].dtype == torch.bfloat16
    assert cached.kv_cache.hits == sum(len(p) + len(g.token_ids) - 1 for p, g in zip(prompts, gens, strict=True))
    assert all(-1e9 < lp <= 0.0 for g in gens + again for lp in g.logprobs)
    cached.generate(prompts, Sampling(temperature=0.0, max_new_tokens=2))  # fp32 again: the rows are rebuilt
    assert cached.kv_cache.keys[0].dtype == torch.float32


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_slots_match_generate_with_grouped_query_attention(tiny_policy: TransformersPolicy, attn: str) -> None:
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(tiny_policy.model.config)
    config.num_attention_heads, config.num_key_value_heads, config._attn_implementation = 4, 2, attn
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    cached = TransformersPolicy(model, tiny_policy.tokenizer, "s", batch_size=8, prefix_cache=8)
    plain = TransformersPolicy(model, tiny_policy.tokenizer, "g", batch_size=8, prefix_cache=0)
    greedy = Sampling(temperature=0.0, max_new_tokens=5)
    prompts = _episode_prompts(cached, 4)
    for _ in range(2):
        got = cached.generate(prompts, greedy)
        assert [g.token_ids for g in got] == [w.token_ids for w in plain.generate(prompts, greedy)]
        prompts = [p + g.token_ids + p[:2] for p, g in zip(prompts, got, strict=True)]
    assert cached.kv_cache.keys[0].shape[1] == 2 and cached.kv_cache.hits > 0


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("additive", [False, True])
def test_shared_prefix_attention_equals_attention_over_each_row(kv_heads: int, additive: bool) -> None:
    """Reading the shared columns once (one matrix product for all rows) gives sdpa's result on the full rows."""
    torch.manual_seed(0)
    rows, q_heads, dim, width, cols = 5, 4, 8, 30, 12
    query = torch.randn(rows, q_heads, 1, dim)
    key, value = torch.randn(rows, kv_heads, width, dim), torch.randn(rows, kv_heads, width, dim)
    key[:, :, :cols], value[:, :, :cols] = key[2, :, :cols], value[2, :, :cols]  # one copy of the prefix per row
    visible = torch.arange(width).view(1, 1, 1, -1) <= torch.tensor([29, 20, 12, 0, 25]).view(-1, 1, 1, 1)
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min) if additive else visible
    token = pc._cascade_state.set((2, cols, "sdpa"))
    try:
        got, _ = pc.shared_prefix_attention(None, query, key, value, mask, scaling=dim ** -0.5)
    finally:
        pc._cascade_state.reset(token)
    group = q_heads // kv_heads
    want = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1), attn_mask=visible)
    assert got.shape == (rows, 1, q_heads, dim)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-6)
    # row 3 sees column 0 only: its output is that column's value, for each query head's kv head
    torch.testing.assert_close(got[3, 0], value[3, :, 0].repeat_interleave(group, 0))


def test_rows_whose_prefix_bits_differ_share_nothing(tiny_policy: TransformersPolicy) -> None:
    cached, _ = _slots(tiny_policy)
    cache = cached.kv_cache
    prompts = [torch.arange(3, 3 + pc.CASCADE_MIN + 10)] * 3
    cache.reserve(3, 100, torch.empty(0), 2, 2, 4)
    for k in cache.keys + cache.values:
        k[:, :, :100] = torch.randn(2, 100, 4)  # the same random prefix in every row
    assert pc._shared_columns(cache, [0, 1, 2], prompts) == pc.CASCADE_MIN + 10
    assert pc._shared_columns(cache, [0, 1], [prompts[0], prompts[1][:-20]]) == 0  # below CASCADE_MIN
    cache.values[1][2, 0, 5, 0] += 1e-6  # one element of one row differs
    assert pc._shared_columns(cache, [0, 1, 2], prompts) == 0
    assert pc._shared_columns(cache, [0, 1], prompts) == pc.CASCADE_MIN + 10


@pytest.mark.parametrize("attn,kv_heads", [("sdpa", None), ("eager", None), ("sdpa", 2)])
def test_decode_reads_a_shared_instruction_once_and_replies_as_generate(
        tiny_policy: TransformersPolicy, attn: str, kv_heads: int | None) -> None:
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(tiny_policy.model.config)
    config._attn_implementation = attn
    if kv_heads:
        config.num_attention_heads, config.num_key_value_heads = 4, kv_heads
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    tok = tiny_policy.tokenizer
    shared = tok.encode("Your task is to cook a meal. Check the cookbook in the kitchen. " * 6, add_special_tokens=False)
    assert len(shared) >= pc.CASCADE_MIN
    prompts = [shared + tok.encode(t, add_special_tokens=False)
               for t in ["take knife", "open fridge now", "You are in the kitchen.", "go north"]]
    greedy = Sampling(temperature=0.0, max_new_tokens=6)
    on = TransformersPolicy(model, tok, "on", batch_size=8, prefix_cache=8, shared_prefix_attention=True)
    off = TransformersPolicy(model, tok, "off", batch_size=8, prefix_cache=8, shared_prefix_attention=False)
    plain = TransformersPolicy(model, tok, "g", batch_size=8, prefix_cache=0)
    for _ in range(2):  # fresh episodes forked from one prefill, then each continuing in its row
        got, ref, want = on.generate(prompts, greedy), off.generate(prompts, greedy), plain.generate(prompts, greedy)
        assert [g.token_ids for g in got] == [w.token_ids for w in want] == [r.token_ids for r in ref]
        for g, r in zip(got, ref, strict=True):
            assert g.logprobs == pytest.approx(r.logprobs, abs=1e-5)
        prompts = [p + g.token_ids + shared[:3] for p, g in zip(prompts, got, strict=True)]
    assert on.kv_cache.shared_steps >= 2 * 5 and off.kv_cache.shared_steps == 0
    assert model.config._attn_implementation == attn  # restored after decoding


@pytest.mark.parametrize("repeats", [1, 6])  # 6: a prefix long enough for shared-prefix attention
def test_sampled_replies_do_not_depend_on_which_rows_the_prompts_land_in(tiny_policy: TransformersPolicy,
                                                                         repeats: int) -> None:
    """A seeded call gives each prompt the same sample whatever cache rows the prompts continue in (drawn in
    prompt order, not row order: a rerun, or a resumed run with a cold cache, samples the same replies)."""
    fresh, _ = _slots(tiny_policy)
    used = TransformersPolicy(fresh.model, tiny_policy.tokenizer, "u", batch_size=8, prefix_cache=16)
    base = tiny_policy.tokenizer.encode("Make the bell ring. There is a button here. " * repeats,
                                        add_special_tokens=False)
    prompts = [base + [t] for t in (11, 12, 13, 14)]
    used.generate(prompts[::-1], Sampling(temperature=0.0, max_new_tokens=3))  # rows 0-3 hold them in reverse
    sampling = Sampling(temperature=1.0, max_new_tokens=6, seed=7)
    want = [g.token_ids for g in fresh.generate(prompts, sampling)]
    got = [g.token_ids for g in used.generate(prompts, sampling)]
    rows = [next(r for r, t in enumerate(used.kv_cache.tokens) if t.tolist()[: len(p)] == p) for p in prompts]
    assert rows == [3, 2, 1, 0]  # each prompt continued in its earlier row, so row order is reversed
    assert got == want
    assert (used.kv_cache.shared_steps > 0) == (len(base) >= pc.CASCADE_MIN)


def test_rollout_config_switches_shared_prefix_attention() -> None:
    from agentevo.config import load_config
    from agentevo.models.policy import initial_policy

    corpus = ["Your task is to cook a meal.", "Action: take knife"]
    tiny = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
            "model.tiny.intermediate_size=64"]
    assert initial_policy(load_config(None, tiny), corpus).shared_prefix_attention is None  # auto: the CPU
    off = initial_policy(load_config(None, [*tiny, "rollout.shared_prefix_attention=false"]), corpus)
    assert off.shared_prefix_attention is False
    with pytest.raises(ConfigError, match="rollout.shared_prefix_attention must be true or false"):
        load_config(None, ["rollout.shared_prefix_attention=cpu"])
