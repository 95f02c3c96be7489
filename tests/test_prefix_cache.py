"""Generation with cross-turn KV reuse: same replies as transformers' generate, and never stale weights."""

from __future__ import annotations

import copy

import pytest
import torch

from agentevo.models.backend import Sampling, TransformersPolicy
from agentevo.models.prefix_cache import PrefixKVCache, _pick, supports_prefix_cache


@pytest.fixture()
def pair(tiny_policy: TransformersPolicy) -> tuple[TransformersPolicy, TransformersPolicy]:
    """The same weights behind a cached and an uncached policy."""
    model = copy.deepcopy(tiny_policy.model)
    cached = TransformersPolicy(model, tiny_policy.tokenizer, "cached", batch_size=4, prefix_cache=16)
    plain = TransformersPolicy(model, tiny_policy.tokenizer, "plain", batch_size=4, prefix_cache=0)
    assert cached.kv_cache is not None and plain.kv_cache is None
    return cached, plain


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
    (entry,) = cached.kv_cache.entries.values()
    assert entry.tokens.tolist() == prompt + gen.token_ids[:-1]  # the last token was never fed in
    assert entry.kv[0][0].shape[1] == len(prompt) + len(gen.token_ids) - 1
    longer = prompt + gen.token_ids + prompt[:3]
    cached.generate([longer], Sampling(temperature=0.0, max_new_tokens=4))
    assert len(cached.kv_cache.entries) == 1  # the entry it grew from was dropped
    assert cached.kv_cache.hits == len(prompt) + len(gen.token_ids) - 1


def test_weight_changes_clear_the_cache(pair) -> None:  # noqa: ANN001
    cached, plain = pair
    greedy = Sampling(temperature=0.0, max_new_tokens=5)
    prompts = _episode_prompts(cached, 3)
    cached.generate(prompts, greedy)
    assert len(cached.kv_cache.entries) == 3
    optimizer = torch.optim.SGD(cached.model.parameters(), lr=0.5)
    loss = cached.model(input_ids=torch.tensor([prompts[0]]), labels=torch.tensor([prompts[0]])).loss
    loss.backward()
    optimizer.step()
    cached.kv_cache.check_weights()
    assert not cached.kv_cache.entries
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
    from agentevo.models.prefix_cache import generate_cached

    cached, _ = pair
    prompts = _episode_prompts(cached, 6)
    args = (0.0, 1.0, 0, )
    free = generate_cached(cached.model, PrefixKVCache(cached.model), prompts, 10, *args, [-1], cached.pad_id)
    # stop at a token row 0 produces third: rows end at different steps (or run to the limit)
    stop = free[0][0][2]
    stopped = generate_cached(cached.model, PrefixKVCache(cached.model), prompts, 10, *args, [stop], cached.pad_id)
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
