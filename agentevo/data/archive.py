"""A run's record without its weights: what `compare` and `report` read, small enough to commit beside a study.

A study's run folders hold checkpoints (hundreds of MB per point for a real model) and every rollout; a machine that
goes away takes them with it, and with them the per-task outcomes that paired comparisons need. `archive_run` copies a
run folder's small files (config.yaml, state.json, metrics.jsonl, report.md, plots/) and an experience.db holding
only the chosen collections (by default the evaluations, `eval/%`) into OUT/NAME, a folder `agentevo compare` and
`agentevo report` accept like the original.
"""

from __future__ import annotations

import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from agentevo.data.store import ExperienceStore
from agentevo.errors import ConfigError
from agentevo.files import replacing_dir

RECORD_FILES = ("config.yaml", "state.json", "metrics.jsonl", "report.md")
RECORD_DIRS = ("plots",)
DEFAULT_COLLECTIONS = ("eval/%",)


@dataclass
class ArchiveSummary:
    """What one archive holds, and what of the run it left out."""

    path: Path
    trajectories: int
    collections: int
    left_out: int
    steps: bool
    size_bytes: int

    def line(self, source: Path) -> str:
        kb = self.size_bytes / 1024
        size = f"{kb / 1024:.1f} MB" if kb >= 1024 else f"{kb:.0f} KB"
        steps = "with their steps" if self.steps else "outcomes only, no steps"
        return (f"{source} -> {self.path}: {_count(self.trajectories, 'trajectory', 'trajectories')} in "
                f"{_count(self.collections, 'collection', 'collections')} ({steps}), {size}; left out: checkpoints "
                f"and {_count(self.left_out, 'other trajectory', 'other trajectories')}")


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def archive_run(run_dir: Path, out: Path, collections: tuple[str, ...] | list[str] = DEFAULT_COLLECTIONS,
                steps: bool = True) -> ArchiveSummary:
    """Write OUT/<run name>: the run's record files and the trajectories of `collections` (SQL LIKE patterns), with
    their steps unless `steps` is False. An older archive of the same name is replaced whole, never half-written."""
    run_dir = Path(run_dir)
    if not (run_dir / "state.json").exists() or not (run_dir / "config.yaml").exists():
        raise ConfigError(f"{str(run_dir)!r} is not a run folder (no state.json or config.yaml); give runs/NAME")
    if not collections:
        raise ConfigError("archive needs at least one --collection pattern (default 'eval/%': the evaluations)")
    dest = Path(out) / run_dir.name
    if dest.resolve() == run_dir.resolve():
        raise ConfigError(f"--out {str(out)!r} would archive {str(run_dir)!r} onto itself; pick another folder")
    source_db = run_dir / "experience.db"
    with replacing_dir(dest) as tmp:
        for name in RECORD_FILES:
            if (run_dir / name).exists():
                shutil.copy2(run_dir / name, tmp / name)
        for name in RECORD_DIRS:
            if (run_dir / name).is_dir():
                shutil.copytree(run_dir / name, tmp / name)
        kept = left_out = n_collections = 0
        if source_db.exists():
            ExperienceStore(tmp / "experience.db").close()  # the store's schema, so the archive opens like a run's
            con = sqlite3.connect((tmp / "experience.db").resolve().as_uri(), uri=True, isolation_level=None)
            try:
                # read-only: never touch the run (a run still going keeps writing its WAL)
                con.execute("ATTACH DATABASE ? AS src", (source_db.resolve().as_uri() + "?mode=ro",))
                where = " OR ".join("collection LIKE ?" for _ in collections)
                con.execute("BEGIN")
                con.execute(f"INSERT INTO main.trajectories SELECT * FROM src.trajectories WHERE {where}",
                            tuple(collections))
                if steps:
                    con.execute("INSERT INTO main.steps SELECT s.* FROM src.steps AS s "
                                "JOIN main.trajectories AS t ON s.traj_id = t.id")
                con.execute("INSERT INTO main.goals (goals) VALUES ('rebuild')")
                con.execute("COMMIT")
                kept = con.execute("SELECT COUNT(*) FROM main.trajectories").fetchone()[0]
                n_collections = con.execute("SELECT COUNT(DISTINCT collection) FROM main.trajectories").fetchone()[0]
                left_out = con.execute("SELECT COUNT(*) FROM src.trajectories").fetchone()[0] - kept
                con.execute("DETACH DATABASE src")
                con.execute("PRAGMA journal_mode=DELETE")  # one file, nothing beside it to forget when committing
                con.execute("VACUUM")
            except sqlite3.Error as exc:
                raise ConfigError(f"could not read {source_db} ({exc}); check the run folder with "
                                  f"`agentevo report {run_dir}`") from None
            finally:
                con.close()
    return ArchiveSummary(dest, kept, n_collections, left_out, steps, _folder_bytes(dest))
