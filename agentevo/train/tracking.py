"""Metrics: one JSON line per record in runs/NAME/metrics.jsonl (plus TensorBoard when installed)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Appends metric records under fixed names; readable while the run goes on (`tail -f metrics.jsonl`)."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, enabled: bool = True) -> None:
        """enabled=False (the other ranks of a distributed run) keeps the reader and writes nothing."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.enabled = enabled
        self._tb: Any = None
        if tensorboard and enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                self._tb = None

    def log(self, phase: str, step: int, metrics: dict[str, Any]) -> None:
        """Write one record: the phase (e.g. 'bc/train', 'eval/bc/test'), a step counter and scalar metrics."""
        if not self.enabled:
            return
        record = {"time": time.time(), "phase": phase, "step": step, **metrics}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record, default=float) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{phase}/{key}", value, step)
            self._tb.flush()

    def records(self, phase: str | None = None) -> list[dict[str, Any]]:
        """All records so far (optionally of one phase)."""
        if not self.path.exists():
            return []
        out = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        return [r for r in out if phase is None or r["phase"] == phase]

    def close(self) -> None:
        """Flush and close TensorBoard."""
        if self._tb is not None:
            self._tb.close()
