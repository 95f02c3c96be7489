"""Every bench also runs in a tiny smoke mode here, so a bench cannot rot unnoticed."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _bench(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A fresh import of bench/<name>.py, run from the repository root (benches read configs/)."""
    monkeypatch.chdir(BENCH.parent)
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop(name, None)
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def smoke_bc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One smoke BC run folder shared by the method and rollout benches (BC is their common, costly start)."""
    sys.path.insert(0, str(BENCH))
    try:
        import benchlib

        return benchlib.bc_run(tmp_path_factory.mktemp("bench-bc"), smoke=True)
    finally:
        sys.path.remove(str(BENCH))


def test_bench_logprobs_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _bench("bench_logprobs", monkeypatch).main(["--smoke"])
    assert out["rel_diff"] < 1e-6  # the chunked path gives the plain path's values
    assert out["plain_mb"] >= 0 and out["chunked_mb"] >= 0  # tiny shapes may not move the peak RSS


def test_bench_packing_smoke(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = _bench("bench_packing", monkeypatch).main(["--smoke", "--out", str(tmp_path / "pack.json")])
    for r in out["results"]:
        assert r["loss_max_abs_diff"] < 1e-4  # packing changes no loss
        assert r["real_tokens"] <= r["packed_tokens"] <= r["padded_tokens"] and r["ratio"] > 0


def test_bench_rollout_smoke_prints_like_for_like_ratios(monkeypatch, capsys, smoke_bc) -> None:  # noqa: ANN001
    out = _bench("bench_rollout", monkeypatch).main(["--smoke", "--model", str(smoke_bc / "checkpoints" / "bc")])
    r = out["rates"]
    assert out["ratios"]["batching (cache on)"] == pytest.approx(r["cache x2"] / r["cache x1"])
    assert out["ratios"]["batching (cache off)"] == pytest.approx(r["no cache x2"] / r["no cache x1"])
    assert out["ratios"]["cache (2 envs)"] == pytest.approx(r["cache x2"] / r["no cache x2"])
    text = capsys.readouterr().out
    assert "CPU: " in text and "AMX: " in text and "load average" in text
    assert "target: batching >= 3x at 16 envs" in text and "(measured at 2 envs, not 16)" in text
    assert "without" not in text  # no mixed ratio (batched with cache vs one at a time without)


def test_bench_qevolve_smoke(monkeypatch, capsys, smoke_bc, tmp_path) -> None:  # noqa: ANN001
    """It crashed on Run.phase's all_ranks keyword; it now passes keywords on and times every phase."""
    times = _bench("bench_qevolve", monkeypatch).main(["--smoke", "--bc-from", str(smoke_bc),
                                                       "--output-dir", str(tmp_path)])
    assert {"round-1/collect", "round-1/critic", "round-1/policy", "eval/round-1"} <= set(times)
    assert "env steps / +1 point held-out success: " in capsys.readouterr().out


def test_bench_methods_smoke(monkeypatch, capsys, smoke_bc, tmp_path) -> None:  # noqa: ANN001
    # Q-Evolve is covered by test_bench_qevolve_smoke; GRPO and RSD here keep the smoke tests fast
    out = _bench("bench_methods", monkeypatch).main(["--smoke", "--bc-from", str(smoke_bc), "--methods", "grpo", "rsd",
                                                     "--output-dir", str(tmp_path)])
    assert out["grpo"]["label"] == "update-1" and out["rsd"]["label"] == "round-1"
    text = capsys.readouterr().out
    assert text.count("env steps / +1 point held-out success: ") == 2


def test_steps_per_point_says_no_gain(monkeypatch) -> None:  # noqa: ANN001
    benchlib = _bench("benchlib", monkeypatch)
    assert benchlib.format_per_point({"per_point": None}) == "no gain"
    assert benchlib.format_per_point({"per_point": 1234.4}) == "1234"


def test_bench_grpo_smoke(monkeypatch, smoke_bc) -> None:  # noqa: ANN001
    out = _bench("bench_grpo", monkeypatch).main(["--smoke", "--model", str(smoke_bc / "checkpoints" / "bc")])
    assert out["rollout_s"] > 0 and out["update_s"] > 0


def test_bench_rsd_smoke_reports_compact_cache_bytes(monkeypatch) -> None:  # noqa: ANN001
    out = _bench("bench_rsd", monkeypatch).main(["--smoke"])
    # top-20: float16 + int16 ids (+ 2 float32 token log-probs) at V=2,048; int32 ids at V=151,936
    assert out["bytes_per_token"][2048]["compact"] == 20 * (2 + 2) + 8 == 88
    assert out["bytes_per_token"][151_936]["compact"] == 20 * (4 + 2) + 8 == 128
    assert out["bytes_per_token"][151_936]["full"] == 4 * 151_936
    assert set(out["variants"][256]) == {"topk-cache", "full-cache", "full-live"}


def test_bench_text_envs_smoke(monkeypatch) -> None:  # noqa: ANN001
    out = _bench("bench_text_envs", monkeypatch).main(["--smoke"])
    assert out["twx-cookingworld"]["episodes"] == 2 and out["twx-cookingworld"]["mean_reward"] == pytest.approx(1.0)


def test_bench_scienceworld_smoke(monkeypatch) -> None:  # noqa: ANN001
    out = _bench("bench_scienceworld", monkeypatch).main(["--smoke"])
    assert out["failures"] == 0 and out["fast"] > 0 and out["stock"] > 0


def test_bench_alfworld_smoke(monkeypatch) -> None:  # noqa: ANN001
    if importlib.util.find_spec("alfworld") is None:
        pytest.skip("alfworld is not installed (pip install -e '.[alfworld]')")
    out = _bench("bench_alfworld", monkeypatch).main(["--smoke"])
    assert out["fast"] > 0 and out["stock"] > 0


def test_bench_vllm_smoke(monkeypatch) -> None:  # noqa: ANN001
    import torch

    if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
        pytest.skip("bench_vllm needs vllm and a CUDA GPU")
    _bench("bench_vllm", monkeypatch).main(["--smoke"])


def test_bench_generate_smoke() -> None:
    """Plain generate, the old prefix path and the slot engine side by side; exit 1 when greedy replies differ."""
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(BENCH / "bench_generate.py"), "--smoke"], cwd=BENCH.parent, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "new / old" in out.stdout or "new/old" in out.stdout


def test_bench_trl_sft_smoke(tmp_path: Path) -> None:
    """agentevo's BC trainer and TRL's SFTTrainer on the same rows: the same first loss, finite ratios."""
    import json
    import math
    import os
    import subprocess

    pytest.importorskip("trl", reason="the bench extra installs trl")
    out_json = tmp_path / "trl.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(BENCH / "bench_trl_sft.py"), "--smoke", "--out", str(out_json)],
                         cwd=BENCH.parent, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = json.loads(out_json.read_text())
    a, b = summary["loss_step1"]
    assert abs(a - b) < 1e-4 and summary["loss_max_abs_diff"] < 1e-4  # both train on the same reply tokens
    assert all(math.isfinite(summary[k]) and summary[k] > 0 for k in ("ratio_steady", "ratio_cpu", "ratio_end_to_end"))


def test_bench_mfu_smoke_counts_palm_flops(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path) -> None:  # noqa: ANN001
    bench = _bench("bench_mfu", monkeypatch)
    # 2 layers of hidden 64, MLP 128: 4*64*64 attention + 3*64*128 MLP per layer, plus the tied 256 x 64 head
    shape = argparse.Namespace(vocab=256, hidden=64, mlp=128, layers=2, heads=2, seq=64, seed=0)
    assert bench.matmul_params(bench.build_model(shape, None)) == 2 * (16384 + 24576) + 16384
    assert bench.model_flops([10, 20], 98304, 2, 64) == 10 * (6 * 98304 + 1536 * 10) + 20 * (6 * 98304 + 1536 * 20)
    assert bench.gpu_peak_tflops("NVIDIA H100 PCIe") == 756.0 and bench.gpu_peak_tflops("NVIDIA H200") == 989.4
    assert bench.gpu_peak_tflops("Some Other GPU") is None
    out = bench.main(["--smoke", "--out", str(tmp_path / "mfu.json")])
    assert out["matmul_params"] == 98304 and out["loss_max_abs_diff"] < 1e-4  # packing changes no loss
    for r in out["results"]:
        assert r["mfu"] == pytest.approx(r["tflops"] / out["peak_tflops"]) and 0 < r["mfu"] < 1
    text = capsys.readouterr().out
    assert "padding-free / padded:" in text and "target: MFU >= 35%" in text
