"""Hand-computed checks of agentevo.algorithms.losses (spec §1.3, §2.3, §4.3, §5, §7)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from agentevo.algorithms.losses import (
    aggregate,
    append_tail_bucket,
    awr_loss,
    bellman_targets,
    clipped_ratio_objective,
    dpo_loss,
    expectile_loss,
    full_forward_kl,
    iql_q_loss,
    iql_value_loss,
    kl_k3,
    nll_loss,
    polyak_update,
    student_topk,
    teacher_topk,
    token_entropy,
    token_logprobs,
    topk_forward_kl,
)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ log-probs


def test_token_logprobs_alignment() -> None:
    # position 0 predicts ids[1] = 1 with p 0.25; position 1 predicts ids[2] = 2 with p 0.7; position 2 is unused
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.2, 0.7], [0.9, 0.05, 0.05]]]))
    ids = torch.tensor([[0, 1, 2]])
    out = token_logprobs(logits + 3.0, ids)  # a constant shift must not matter
    assert out.shape == (1, 2)
    assert_close(out, torch.log(t(0.25, 0.7)).unsqueeze(0))


def test_token_logprobs_bf16_in_float32_out() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    out = token_logprobs(logits.bfloat16(), ids)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.bfloat16().float()[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert_close(out, ref)


@pytest.mark.parametrize("chunk", [1, 3, 7, 1024])
def test_token_logprobs_chunked_equals_plain_values_and_gradients(chunk: int) -> None:
    # the chunked custom backward (onehot - softmax per chunk) against autograd through log_softmax, in float64
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 6, 13, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 13, (3, 6), generator=g)
    weights = torch.randn(3, 5, generator=g, dtype=torch.float64)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    plain = torch.log_softmax(a[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    chunked = token_logprobs(b, ids, chunk_tokens=chunk)
    assert_close(chunked.double(), plain, atol=1e-6, rtol=1e-6)
    (plain * weights).sum().backward()
    (chunked.double() * weights).sum().backward()
    assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-6)
    assert b.grad[:, -1].abs().sum() == 0  # the last position predicts nothing


def test_token_logprobs_gradient_keeps_the_logits_dtype() -> None:
    logits = torch.randn(2, 4, 9).bfloat16().requires_grad_(True)
    ids = torch.randint(0, 9, (2, 4))
    token_logprobs(logits, ids, chunk_tokens=2).sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    # each position's gradient row sums to 0 (onehot - softmax), up to bf16 rounding
    assert logits.grad.float()[:, :-1].sum(-1).abs().max() < 2e-2


def test_token_logprobs_single_position_is_empty() -> None:
    out = token_logprobs(torch.randn(2, 1, 5), torch.zeros(2, 1, dtype=torch.long))
    assert out.shape == (2, 0) and out.dtype == torch.float32


def test_token_entropy() -> None:
    uniform = torch.zeros(2, 3, 8)
    assert_close(token_entropy(uniform), torch.full((2, 3), math.log(8)))
    peaked = torch.tensor([[0.0, -math.inf, -math.inf]])
    assert_close(token_entropy(peaked), t(0.0))
    # p = (0.5, 0.5, 0) -> log 2, and the −inf entry does not produce NaN
    assert_close(token_entropy(torch.tensor([[1.0, 1.0, -math.inf]])), t(math.log(2)))


# ------------------------------------------------------------------------------------------------ aggregation


VALUES = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, math.inf, math.nan], [5.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 40.0 / 6.0),  # (1+2+3+4+10+20) / 6 tokens
        ("seq-mean-token-mean", (2.5 + 15.0) / 2.0),  # empty third row is not a sequence
        ("seq-mean-token-sum", (10.0 + 30.0) / 2.0),
    ],
)
def test_aggregate_ragged_mask(mode: str, expected: float) -> None:
    assert aggregate(VALUES, MASK, mode).item() == pytest.approx(expected)


def test_aggregate_gradients_per_mode() -> None:
    v = torch.ones(3, 4, requires_grad=True)
    aggregate(v, MASK, "token-mean").backward()
    assert_close(v.grad, MASK.float() / 6.0)
    v.grad = None
    aggregate(v, MASK, "seq-mean-token-mean").backward()
    assert_close(v.grad, torch.tensor([[1 / 8] * 4, [1 / 4, 1 / 4, 0, 0], [0.0] * 4]))


def test_aggregate_empty_mask_and_errors() -> None:
    v = torch.ones(2, 3, requires_grad=True)
    out = aggregate(v, torch.zeros(2, 3, dtype=torch.bool), "seq-mean-token-mean")
    assert out.item() == 0.0
    out.backward()  # still part of the graph
    with pytest.raises(ValueError):
        aggregate(v, torch.ones(2, 3), "mean")
    with pytest.raises(ValueError):
        aggregate(v, torch.ones(3, 2), "token-mean")


def test_nll_loss() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.125, 1.0]]))
    mask = torch.tensor([[1, 1], [1, 0]])
    assert nll_loss(logp, mask).item() == pytest.approx((1 + 2 + 3) * math.log(2) / 3)


# ------------------------------------------------------------------------------------------------ IQL


def test_expectile_loss_values_and_gradient_sign() -> None:
    assert_close(expectile_loss(t(2.0, -2.0, 0.0), 0.7), t(2.8, 1.2, 0.0))
    v = torch.zeros(2, requires_grad=True)
    target = t(1.0, -1.0)
    expectile_loss(target - v, 0.7).sum().backward()
    # target above V: d/dV 0.7·(1 − V)² = −1.4 (raise V); target below: d/dV 0.3·(−1 − V)² = +0.6 (lower V)
    assert_close(v.grad, t(-1.4, 0.6))


def _expectile_by_bisection(x: list[float], tau: float) -> float:
    """Root of τ·Σ(x − m)_+ − (1 − τ)·Σ(m − x)_+ (decreasing in m)."""
    lo, hi = min(x), max(x)
    for _ in range(100):
        m = 0.5 * (lo + hi)
        f = tau * sum(max(xi - m, 0.0) for xi in x) - (1 - tau) * sum(max(m - xi, 0.0) for xi in x)
        lo, hi = (m, hi) if f > 0 else (lo, m)
    return 0.5 * (lo + hi)


@pytest.mark.parametrize(("tau", "closed_form"), [(0.7, 3.1875), (0.5, 2.25)])
def test_expectile_minimiser(tau: float, closed_form: float) -> None:
    # sample {0, 1, 2, 6}, τ=0.7: with 2 < m < 6, 0.7·(6 − m) = 0.3·(3m − 3) -> m = 5.1/1.6 = 3.1875; τ=0.5: the mean
    x = [0.0, 1.0, 2.0, 6.0]
    assert _expectile_by_bisection(x, tau) == pytest.approx(closed_form, abs=1e-9)
    m = torch.zeros((), requires_grad=True)
    opt = torch.optim.SGD([m], lr=0.5)
    for _ in range(300):
        opt.zero_grad()
        iql_value_loss(torch.tensor(x), m.expand(4), tau=tau).backward()
        opt.step()
    assert m.item() == pytest.approx(closed_form, abs=1e-4)


def test_iql_value_loss_weighted_and_target_detached() -> None:
    q = torch.tensor([1.0, 0.0], requires_grad=True)
    v = torch.tensor([0.0, 1.0], requires_grad=True)
    # residuals +1, −1 -> 0.7, 0.3; weights 1, 3 -> (0.7 + 0.9) / 4
    loss = iql_value_loss(q, v, t(1.0, 3.0), tau=0.7)
    assert loss.item() == pytest.approx(0.4)
    loss.backward()
    assert q.grad is None and v.grad is not None
    assert iql_value_loss(q, v, None, tau=0.7).item() == pytest.approx(0.5)


def test_iql_q_loss_sums_heads_and_weights_steps() -> None:
    q1, q2 = torch.tensor([1.0, 2.0], requires_grad=True), t(0.0, 2.0)
    y = torch.tensor([1.0, 1.0], requires_grad=True)
    # step 1: 0² + 1² = 1; step 2: 1² + 1² = 2
    assert iql_q_loss([q1, q2], y, t(1.0, 1.0)).item() == pytest.approx(1.5)
    loss = iql_q_loss(torch.stack([q1, q2]), y, t(3.0, 1.0))
    assert loss.item() == pytest.approx((3.0 + 2.0) / 4.0)
    loss.backward()
    assert y.grad is None and q1.grad is not None


def test_bellman_targets() -> None:
    next_v = torch.tensor([0.5, 0.7], requires_grad=True)
    y = bellman_targets(t(0.0, 1.0), next_v, torch.tensor([False, True]), 0.9)
    assert_close(y, t(0.45, 1.0))
    assert not y.requires_grad


def test_polyak_update() -> None:
    target = torch.nn.Parameter(t(0.0, 0.0))
    online = torch.nn.Parameter(t(1.0, 2.0))
    polyak_update([target], [online], 0.1)
    assert_close(target.data, t(0.1, 0.2))
    assert_close(online.data, t(1.0, 2.0))
    with pytest.raises(ValueError):
        polyak_update([target], [online, online], 0.1)
    with pytest.raises(ValueError):
        polyak_update([target], [online], 1.5)


# ------------------------------------------------------------------------------------------------ clipped ratio

RATIOS = [0.6, 0.75, 1.0, 1.15, 1.3]


def _ratio_grads(ratios: list[float], adv: float, eps_low: float, eps_high: float) -> torch.Tensor:
    logp = torch.log(torch.tensor(ratios)).requires_grad_(True)
    loss, _ = clipped_ratio_objective(
        logp, torch.zeros(len(ratios)), torch.full((len(ratios),), adv), torch.ones(len(ratios)), eps_low, eps_high
    )
    loss.backward()
    assert logp.grad is not None
    return logp.grad


def test_clipped_ratio_gradient_positive_advantage() -> None:
    # band [0.72, 1.2]; A > 0: only ratio > 1 + ε_high is clipped; unclipped grad of −ηA/N w.r.t. log η is −ηA/N
    g = _ratio_grads(RATIOS, 1.0, 0.28, 0.2)
    assert g[4].item() == 0.0
    assert bool((g[:4] != 0).all())
    assert_close(g[:4], -t(0.6, 0.75, 1.0, 1.15) / 5)


def test_clipped_ratio_gradient_negative_advantage() -> None:
    # A < 0: only ratio < 1 − ε_low is clipped
    g = _ratio_grads(RATIOS, -1.0, 0.28, 0.2)
    assert g[0].item() == 0.0
    assert bool((g[1:] != 0).all())
    assert_close(g[1:], t(0.75, 1.0, 1.15, 1.3) / 5)


def test_clipped_ratio_asymmetry() -> None:
    # ratio 0.75 with A < 0 still moves under Q-Evolve's ε_low=0.28 but is clipped with a symmetric 0.2
    assert _ratio_grads([0.75], -1.0, 0.28, 0.2)[0].item() != 0.0
    assert _ratio_grads([0.75], -1.0, 0.2, 0.2)[0].item() == 0.0
    # ratio 1.25 with A > 0 is clipped under ε_high=0.2 but moves in DAPO's direction (ε_high=0.28)
    assert _ratio_grads([1.25], 1.0, 0.28, 0.2)[0].item() == 0.0
    assert _ratio_grads([1.25], 1.0, 0.2, 0.28)[0].item() != 0.0


def test_clipped_ratio_loss_value_and_stats() -> None:
    loss, _ = clipped_ratio_objective(
        torch.log(torch.tensor(RATIOS)), torch.zeros(5), torch.ones(5), torch.ones(5), 0.28, 0.2
    )
    assert loss.item() == pytest.approx(-(0.6 + 0.75 + 1.0 + 1.15 + 1.2) / 5)

    ratios = t(0.6, 0.6, 1.3, 1.3, 1.0, 0.5)
    adv = t(-1.0, 1.0, 1.0, -1.0, 1.0, -1.0)
    mask = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool)
    _, stats = clipped_ratio_objective(torch.log(ratios), torch.zeros(6), adv, mask, 0.28, 0.2)
    # low side: token 0 only (token 5 is masked out); high side: token 2 only; 5 masked-in tokens
    assert stats["clip_frac_low"].item() == pytest.approx(0.2)
    assert stats["clip_frac_high"].item() == pytest.approx(0.2)
    assert stats["ratio_mean"].item() == pytest.approx((0.6 + 0.6 + 1.3 + 1.3 + 1.0) / 5)
    _, sym = clipped_ratio_objective(torch.log(t(0.75)), torch.zeros(1), t(-1.0), torch.ones(1), 0.2, 0.2)
    _, asym = clipped_ratio_objective(torch.log(t(0.75)), torch.zeros(1), t(-1.0), torch.ones(1), 0.28, 0.2)
    assert sym["clip_frac_low"].item() == 1.0 and asym["clip_frac_low"].item() == 0.0


def test_clipped_ratio_old_logp_and_adv_are_constants() -> None:
    logp = torch.zeros(3, requires_grad=True)
    old = torch.zeros(3, requires_grad=True)
    adv = torch.ones(3, requires_grad=True)
    loss, _ = clipped_ratio_objective(logp, old, adv, torch.ones(3), 0.28, 0.2, mode="seq-mean-token-sum")
    loss.backward()
    assert old.grad is None and adv.grad is None and logp.grad is not None


# ------------------------------------------------------------------------------------------------ k3 KL


def test_kl_k3() -> None:
    g = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    assert bool((kl_k3(logp, ref) >= 0).all())
    tiny = torch.linspace(-1e-4, 1e-4, 101)
    assert bool((kl_k3(tiny, torch.zeros(101)) >= 0).all())
    assert bool((kl_k3(logp, logp) == 0).all())
    # lr = ln 2 -> 2 − ln 2 − 1
    assert kl_k3(t(0.0), torch.log(t(2.0))).item() == pytest.approx(1.0 - math.log(2.0))
    p = torch.zeros(3, requires_grad=True)
    r = torch.zeros(3, requires_grad=True)
    kl_k3(p, r).sum().backward()
    assert r.grad is None
    assert_close(p.grad, torch.zeros(3))  # minimum at equality
    # the cap: a token 12 nats below the reference is worth 10, not e^12 - 13 (162,742), and pulls no gradient
    far = torch.tensor([-12.0, -1.0], requires_grad=True)
    k3 = kl_k3(far, torch.zeros(2))
    assert k3.tolist() == pytest.approx([10.0, math.e - 2.0])
    assert kl_k3(far, torch.zeros(2), max_value=None)[0].item() == pytest.approx(math.exp(12.0) - 13.0)
    k3.sum().backward()
    assert far.grad.tolist() == pytest.approx([0.0, -(math.e - 1.0)])


# ------------------------------------------------------------------------------------------------ distillation KL


def test_topk_kl_equals_full_kl_when_k_is_vocab() -> None:
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g) * 2
    for temp in (1.0, 2.0):
        ids, lp = teacher_topk(teacher, 7, temperature=temp)
        full = full_forward_kl(student, teacher, temperature=temp)
        assert_close(topk_forward_kl(student, ids, lp), full)
        assert_close(topk_forward_kl(student, ids, lp, tail_bucket=True), full, atol=1e-5, rtol=1e-5)
    assert bool((full >= 0).all())
    assert_close(full_forward_kl(teacher, teacher), torch.zeros(2, 3), atol=1e-6, rtol=0)


def test_topk_kl_hand_values() -> None:
    teacher = torch.log(t(0.5, 0.3, 0.15, 0.05))
    student = torch.zeros(4)  # uniform
    ids, lp = teacher_topk(teacher, 2)
    assert ids.tolist() == [0, 1]
    # renormalised over K: p̃_T = (0.625, 0.375), p̃_S = (0.5, 0.5)
    expected = 0.625 * math.log(1.25) + 0.375 * math.log(0.75)
    assert topk_forward_kl(student, ids, lp).item() == pytest.approx(expected, abs=1e-6)
    # tail bucket: teacher (0.5, 0.3 | 0.2), student (0.25, 0.25 | 0.5)
    expected_tail = 0.5 * math.log(2.0) + 0.3 * math.log(1.2) + 0.2 * math.log(0.4)
    assert topk_forward_kl(student, ids, lp, tail_bucket=True).item() == pytest.approx(expected_tail, abs=1e-6)


def test_tail_bucket_sums_to_one() -> None:
    g = torch.Generator().manual_seed(3)
    logp = torch.log_softmax(torch.randn(4, 50, generator=g), dim=-1)
    for k in (1, 5, 20, 50):
        top = logp.topk(k, dim=-1).values
        with_tail = append_tail_bucket(top)
        assert with_tail.shape == (4, k + 1)
        assert torch.isfinite(with_tail).all()
        assert_close(with_tail.exp().sum(-1), torch.ones(4), atol=1e-6, rtol=0)


def test_distillation_gradient_only_into_student() -> None:
    g = torch.Generator().manual_seed(4)
    student = torch.randn(3, 10, generator=g).requires_grad_(True)
    teacher = torch.randn(3, 10, generator=g).requires_grad_(True)
    ids, lp = teacher_topk(teacher, 4)
    assert not lp.requires_grad
    lp_leaf = lp.clone().requires_grad_(True)
    for tail in (False, True):
        student.grad = None
        topk_forward_kl(student, ids, lp_leaf, tail_bucket=tail).sum().backward()
        assert student.grad is not None and student.grad.abs().sum() > 0
        assert lp_leaf.grad is None
    student.grad = None
    full_forward_kl(student, teacher).sum().backward()
    assert student.grad is not None and teacher.grad is None


def test_student_topk() -> None:
    student = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    teacher = torch.log(torch.tensor([[0.4, 0.1, 0.2, 0.3]]))
    ids, lp = student_topk(student, teacher, 2)
    assert ids.tolist() == [[1, 3]]
    assert_close(lp, torch.log(torch.tensor([[0.1, 0.3]])))
    kl = topk_forward_kl(student, ids, lp, tail_bucket=True)
    assert kl.shape == (1,) and kl.item() > 0


# ------------------------------------------------------------------------------------------------ DPO / AWR


def test_dpo_loss_hand_values() -> None:
    pc = torch.tensor([-1.0, -2.0], requires_grad=True)
    pr = torch.tensor([-2.0, -1.0], requires_grad=True)
    ref = torch.full((2,), -1.5, requires_grad=True)
    losses, stats = dpo_loss(pc, pr, ref, ref, beta=0.5)
    # logits β[(πw − ref) − (πl − ref)] = ±0.5 -> −log σ(±0.5)
    assert_close(losses, t(math.log1p(math.exp(-0.5)), math.log1p(math.exp(0.5))))
    assert stats["reward_accuracy"].item() == 0.5
    assert stats["reward_margin"].item() == pytest.approx(0.0)
    assert stats["reward_chosen"].item() == pytest.approx(0.0)  # (0.25 − 0.25) / 2
    losses.sum().backward()
    assert ref.grad is None and pc.grad is not None


def test_awr_loss() -> None:
    logp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], requires_grad=True)
    w = torch.tensor([[2.0, 1.0], [0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss = awr_loss(logp, w, mask)
    assert loss.item() == pytest.approx((2 * 1 + 1 * 2 + 0.5 * 3) / 3)
    loss.backward()
    assert w.grad is None
    assert_close(logp.grad, -torch.tensor([[2.0, 1.0], [0.5, 0.0]]) / 3)
