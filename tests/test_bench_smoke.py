"""Every bench also runs in a tiny smoke mode here, so a bench cannot rot unnoticed."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_bench_logprobs_smoke(monkeypatch) -> None:
    monkeypatch.chdir(BENCH.parent)
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_logprobs", None)
    import bench_logprobs

    out = bench_logprobs.main(["--smoke"])
    assert out["rel_diff"] < 1e-6  # the chunked path gives the plain path's values
    assert out["plain_mb"] > 0 and out["chunked_mb"] > 0
