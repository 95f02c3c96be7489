"""optim.padding_free: samples packed end to end without padding give the same log-probs, losses and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from agentevo.algorithms.bc import nll_loss
from agentevo.config import OptimConfig, load_config
from agentevo.data.tensors import StepSample, collate, collate_padding_free, pack_batch, pack_bins, reply_logprobs
from agentevo.errors import ConfigError
from agentevo.train.loop import train


def test_pack_bins_first_fit_decreasing() -> None:
    # longest first: 5 fills a row; 4 opens a row (room 1); 3 opens one (room 2); 2 joins the 3; 1 joins the 4
    assert pack_bins([5, 3, 2, 4, 1], 5) == [[0], [3, 4], [1, 2]]
    assert pack_bins([2, 2, 2], 6) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="a sample of 7 tokens does not fit a packed row of 6"):
        pack_bins([7], 6)


def test_pack_batch_moves_every_tensor_with_its_tokens() -> None:
    a = StepSample(input_ids=[11, 12, 13, 14, 15], spans=[(3, 5)], traj_index=0, steps=[2], labels={"adv": [0.5]},
                   token_labels={"old_logp": [-1.0, -2.0]})
    b = StepSample(input_ids=[21, 22, 23], spans=[(2, 3)], traj_index=1, steps=[1], labels={"adv": [-1.0]},
                   token_labels={"old_logp": [-3.0]})
    c = StepSample(input_ids=[31, 32], spans=[(1, 2)], traj_index=2, steps=[4], labels={"adv": [2.0]},
                   token_labels={"old_logp": [-4.0]})
    packed = pack_batch(collate([a, b, c], pad_id=0), pad_id=0)
    assert "attention_mask" not in packed
    assert packed["input_ids"].tolist() == [[11, 12, 13, 14, 15], [21, 22, 23, 31, 32]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert packed["action_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 0, 1]]
    assert packed["step_id"].tolist() == [[-1, -1, -1, 2, 2], [-1, -1, 1, -1, 4]]
    assert packed["adv"].tolist() == [[0, 0, 0, 0.5, 0.5], [0, 0, -1.0, 0, 2.0]]
    assert packed["old_logp"].tolist() == [[0, 0, 0, -1.0, -2.0], [0, 0, -3.0, 0, -4.0]]
    # a row with room left: pad tokens form a segment of their own (positions restart), outside every mask
    d = StepSample(input_ids=[41, 42, 43, 44], spans=[(3, 4)], traj_index=3, steps=[1])
    tail = pack_batch(collate([a, d], pad_id=0), pad_id=0)
    assert tail["input_ids"].tolist() == [[11, 12, 13, 14, 15], [41, 42, 43, 44, 0]]
    assert tail["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0]]
    assert tail["step_id"].tolist()[1] == [-1, -1, -1, 1, -1]


def _rows(policy, lengths: list[tuple[int, int]]) -> list[StepSample]:  # noqa: ANN001
    """Samples of (prompt, reply) lengths from a fixed token stream."""
    g = torch.Generator().manual_seed(0)
    vocab = policy.model.config.vocab_size
    out = []
    for k, (p, r) in enumerate(lengths):
        ids = torch.randint(5, vocab, (p + r,), generator=g).tolist()
        out.append(StepSample(input_ids=ids, spans=[(p, p + r)], traj_index=k, steps=[k + 1]))
    return out


def test_packed_logprobs_loss_and_gradient_equal_the_padded_ones(tiny_policy) -> None:  # noqa: ANN001
    """Five samples of very different lengths: padded they are 5 rows of 40; packed, 3 rows of 40. Every reply
    token's log-prob, the token-mean NLL and its gradient agree (the block-diagonal mask keeps samples apart; a leak
    across samples or a position that did not restart would change the later samples' log-probs)."""
    samples = _rows(tiny_policy, [(30, 10), (12, 4), (8, 3), (20, 6), (5, 2)])
    padded, packed = collate(samples, tiny_policy.pad_id), collate_padding_free(samples, tiny_policy.pad_id)
    assert tuple(padded["input_ids"].shape) == (5, 40) and tuple(packed["input_ids"].shape) == (3, 40)
    model = copy.deepcopy(tiny_policy.model).float()
    lp_pad, m_pad = reply_logprobs(model, padded)
    lp_pack, m_pack = reply_logprobs(model, packed)
    assert int(m_pad.sum()) == int(m_pack.sum()) == 25
    # the same reply tokens in another order: each sample's values, in token order, found by its step id

    def by_sample(lp: torch.Tensor, batch: dict) -> dict[int, list[float]]:
        ids = batch["step_id"]
        return {k: lp[ids == k].tolist() for k in range(1, 6)}

    expected = by_sample(lp_pad, padded)
    got = by_sample(lp_pack, packed)
    for k in expected:
        assert len(got[k]) == len(expected[k]) and got[k] == pytest.approx(expected[k], abs=1e-5), k
    grads = []
    for batch in (padded, packed):
        model.zero_grad()
        loss, stats = nll_loss(model, batch)
        loss.backward()
        grads.append((float(loss.detach()), [p.grad.clone() for p in model.parameters()]))
    assert grads[1][0] == pytest.approx(grads[0][0], abs=1e-5)
    for g_pad, g_pack in zip(grads[0][1], grads[1][1], strict=True):
        assert torch.allclose(g_pad, g_pack, atol=1e-5)
    # without position ids restarting the packed rows would read the wrong context: the check above can fail
    broken = dict(packed, position_ids=torch.arange(40).expand(3, 40))
    lp_broken, _ = reply_logprobs(model, broken)
    leaked = by_sample(lp_broken, packed)
    assert max(abs(a - b) for k in expected for a, b in zip(leaked[k], expected[k], strict=True)) > 1e-2


def test_one_row_packing_for_flash_attention(tiny_policy) -> None:  # noqa: ANN001
    """Under flash-attention (variable-length kernels) a micro-batch becomes one row of all its tokens; the values
    are the padded ones (checked here with sdpa's block-diagonal mask, which computes the same thing)."""
    from agentevo.data.tensors import padding_free_collate

    samples = _rows(tiny_policy, [(30, 10), (12, 4), (8, 3)])
    one = collate_padding_free(samples, tiny_policy.pad_id, one_row=True)
    assert tuple(one["input_ids"].shape) == (1, 67)
    assert one["position_ids"][0].tolist() == [*range(40), *range(16), *range(11)]
    model = copy.deepcopy(tiny_policy.model).float()
    lp_one, m_one = reply_logprobs(model, one)
    lp_pad, m_pad = reply_logprobs(model, collate(samples, tiny_policy.pad_id))
    assert lp_one[m_one.bool()].tolist() == pytest.approx(lp_pad[m_pad.bool()].tolist(), abs=1e-5)  # same order
    assert padding_free_collate(model) is collate_padding_free  # sdpa: rows no wider than the longest sample
    flash = copy.deepcopy(model)
    flash.config._attn_implementation = "flash_attention_2"
    assert tuple(padding_free_collate(flash)(samples, tiny_policy.pad_id)["input_ids"].shape) == (1, 67)


def test_train_padding_free_follows_the_padded_loss_curve(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    samples = _rows(tiny_policy, [(30, 6), (10, 4), (8, 3), (24, 5), (6, 2), (14, 4), (9, 3), (20, 5)])
    curves = {}
    for free in (False, True):
        cfg = OptimConfig(lr=3e-3, epochs=3, batch_size=4, micro_batch_size=4, warmup_ratio=0.0, save_every=0,
                          padding_free=free)
        model = copy.deepcopy(tiny_policy.model).float()
        seen: list[float] = []
        train(model, samples, nll_loss, cfg, tiny_policy.pad_id, tmp_path / str(free), seed=0,
              on_step=lambda s, n, r: seen.append(r["loss"]))  # noqa: B023
        curves[free] = seen
    assert len(curves[True]) == len(curves[False]) == 6
    assert curves[True] == pytest.approx(curves[False], abs=2e-4)
    assert curves[True][-1] < curves[True][0] - 0.5


def test_padding_free_refuses_per_sequence_loss_aggregation() -> None:
    with pytest.raises(ConfigError, match=r"optim.padding_free packs several samples into one row, so "
                                          r"grpo.loss_agg=seq-mean-token-mean would average over packed rows"):
        load_config(None, ["optim.padding_free=true", "grpo.loss_agg=seq-mean-token-mean"], method="selfguide")
    with pytest.raises(ConfigError, match="qevolve.loss_agg=seq-mean-token-sum"):
        load_config(None, ["optim.padding_free=true", "qevolve.loss_agg=seq-mean-token-sum"], method="qevolve")
    # another method's section is not in use: no error
    assert load_config(None, ["optim.padding_free=true", "qevolve.loss_agg=seq-mean-token-sum"],
                       method="bc").optim.padding_free


def test_verify_packing_catches_a_model_that_lets_samples_read_each_other(tiny_policy) -> None:  # noqa: ANN001
    from agentevo.data.tensors import verify_packing

    model = copy.deepcopy(tiny_policy.model).float()
    verify_packing(model, model.config.vocab_size)  # transformers' Llama: the packed sample equals it alone

    class Leaky(torch.nn.Module):  # drops position ids, as a model without packed-sequence masks would
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, input_ids, position_ids=None, use_cache=False):  # noqa: ANN001, ANN201
            return self.inner(input_ids=input_ids, use_cache=use_cache)

    with pytest.raises(ConfigError, match="this model lets packed samples attend to each other"):
        verify_packing(Leaky(), model.config.vocab_size)
