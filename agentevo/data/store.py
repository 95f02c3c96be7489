"""The experience store: one SQLite file per run (WAL mode), each trajectory committed as it finishes."""

from __future__ import annotations

import dataclasses
import json
import re
import sqlite3
import threading
import time
from array import array
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.errors import AgentevoError
from agentevo.files import replacing

_SCHEMA = """
CREATE TABLE IF NOT EXISTS trajectories (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    collection TEXT NOT NULL,
    slot INTEGER NOT NULL,
    task_id TEXT NOT NULL,
    env TEXT NOT NULL,
    split TEXT NOT NULL,
    task_type TEXT NOT NULL,
    task_json TEXT NOT NULL,
    source TEXT NOT NULL,
    policy_id TEXT NOT NULL,
    instruction TEXT NOT NULL,
    goal TEXT NOT NULL,
    final_reward REAL NOT NULL,
    success INTEGER NOT NULL,
    n_steps INTEGER NOT NULL,
    meta_json TEXT NOT NULL,
    created REAL NOT NULL,
    UNIQUE (collection, slot)
);
CREATE TABLE IF NOT EXISTS steps (
    traj_id INTEGER NOT NULL REFERENCES trajectories(id) ON DELETE CASCADE,
    t INTEGER NOT NULL,
    obs TEXT NOT NULL,
    action_text TEXT NOT NULL,
    action_ids BLOB NOT NULL,
    logprobs BLOB,
    parsed_action TEXT,
    next_obs TEXT NOT NULL,
    reward REAL NOT NULL,
    done INTEGER NOT NULL,
    score REAL NOT NULL,
    signal TEXT NOT NULL,
    info_json TEXT NOT NULL,
    PRIMARY KEY (traj_id, t)
);
CREATE INDEX IF NOT EXISTS trajectories_collection ON trajectories (collection);
CREATE INDEX IF NOT EXISTS trajectories_task ON trajectories (task_id);
CREATE VIRTUAL TABLE IF NOT EXISTS goals USING fts5 (goal, content='trajectories', content_rowid='id');
"""

_STOP_WORDS = frozenset(
    "a an the and or of to in on at for with from by is are be it its this that your you then into some "
    "put place find take use them their there here what which who how do does did not no".split()
)


def content_words(text: str) -> set[str]:
    """Lower-cased alphabetic tokens minus stop-words (RSD's precedent ranking key)."""
    return {w for w in re.findall(r"[a-z]+", text.lower()) if w not in _STOP_WORDS and len(w) > 1}


def _ints(blob: bytes | None) -> list[int]:
    a = array("i")
    if blob:
        a.frombytes(blob)
    return a.tolist()


def _floats(blob: bytes | None) -> list[float] | None:
    if blob is None:
        return None
    a = array("f")
    a.frombytes(blob)
    return a.tolist()


class ExperienceStore:
    """Trajectories grouped in named collections (e.g. 'expert', 'round-1/collect', 'eval/bc/test')."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            # a truncated or overwritten file fails here, with one line naming it, not later mid-phase
            problems = [str(r[0]) for r in self._db.execute("PRAGMA quick_check").fetchall()]
            if problems != ["ok"]:
                raise sqlite3.DatabaseError("; ".join(problems[:3]))
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            self._db.close()
            detail = " ".join(str(exc).split())
            raise AgentevoError(
                f"experience store {self.path} is damaged ({detail}); restore it from a copy (with its -wal file), "
                "or move the run folder aside and start the run again") from None

    def close(self) -> None:
        """Close the connection."""
        self._db.close()

    # -- writing -------------------------------------------------------------------------------
    def add(self, traj: Trajectory, collection: str, slot: int) -> int:
        """Store a finished trajectory in one transaction; returns its id. A (collection, slot) pair is written once."""
        t = traj.task
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                cur.execute(
                    "INSERT INTO trajectories (collection, slot, task_id, env, split, task_type, task_json, source, "
                    "policy_id, instruction, goal, final_reward, success, n_steps, meta_json, created) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        collection, slot, t.task_id, t.env, t.split, t.task_type, json.dumps(t.to_dict()),
                        traj.source, traj.policy_id, traj.instruction, traj.goal, traj.final_reward,
                        int(traj.success), len(traj.steps), json.dumps(traj.meta, default=str), time.time(),
                    ),
                )
                traj_id = int(cur.lastrowid or 0)
                cur.executemany(
                    "INSERT INTO steps VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    [
                        (
                            traj_id, s.t, s.obs, s.action_text, array("i", s.action_ids).tobytes(),
                            None if s.logprobs is None else array("f", s.logprobs).tobytes(),
                            s.parsed_action, s.next_obs, s.reward, int(s.done), s.score, s.signal,
                            json.dumps(s.info, default=str),
                        )
                        for s in traj.steps
                    ],
                )
                cur.execute("INSERT INTO goals (rowid, goal) VALUES (?, ?)", (traj_id, traj.goal))
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise
        return traj_id

    def add_missing(self, collection: str, slotted: Iterable[tuple[int, Trajectory]]) -> None:
        """Store trajectories read from another run's store under the given slots, skipping slots already stored (a
        resumed import); the other store's bookkeeping in their meta (store_id, collection, slot) is dropped."""
        done = self.done_slots(collection)
        for slot, traj in slotted:
            if slot not in done:
                meta = {k: v for k, v in traj.meta.items() if k not in ("store_id", "collection", "slot")}
                self.add(dataclasses.replace(traj, meta=meta), collection, slot)

    # -- reading -------------------------------------------------------------------------------
    def done_slots(self, collection: str) -> set[int]:
        """Slots of a collection already stored (what a resumed run skips)."""
        with self._lock:
            rows = self._db.execute("SELECT slot FROM trajectories WHERE collection = ?", (collection,)).fetchall()
        return {int(r[0]) for r in rows}

    def count(self, collection: str | None = None) -> int:
        """Number of stored trajectories (in one collection, or all)."""
        with self._lock:
            if collection is None:
                return int(self._db.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0])
            return int(
                self._db.execute("SELECT COUNT(*) FROM trajectories WHERE collection = ?", (collection,)).fetchone()[0]
            )

    def by_task_type(self, collection: str) -> list[tuple[str, int, float, float]]:
        """(task type, trajectories, mean final reward, success rate) of one collection, by task type."""
        with self._lock:
            rows = self._db.execute(
                "SELECT task_type, COUNT(*), AVG(final_reward), AVG(success) FROM trajectories WHERE collection = ? "
                "GROUP BY task_type ORDER BY MIN(slot)", (collection,)).fetchall()
        return [(str(t), int(n), float(r), float(s)) for t, n, r, s in rows]

    def collections(self) -> list[str]:
        """Names of all collections, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT collection, MIN(id) FROM trajectories GROUP BY collection ORDER BY 2").fetchall()
        return [r[0] for r in rows]

    def load(
        self,
        collection: str | None = None,
        prefix: str | None = None,
        source: str | None = None,
        success: bool | None = None,
        ids: list[int] | None = None,
    ) -> list[Trajectory]:
        """Trajectories matching the filters, with their steps, in slot order: collections in the order they were
        started (each one's first stored trajectory), then by slot within each. Slot order, not the order episodes
        finished, so a run resumed after a kill trains on the same sequence as an uninterrupted one."""
        where, args = [], []
        if collection is not None:
            where.append("collection = ?")
            args.append(collection)
        if prefix is not None:
            where.append("collection LIKE ?")
            args.append(prefix + "%")
        if source is not None:
            where.append("source = ?")
            args.append(source)
        if success is not None:
            where.append("success = ?")
            args.append(int(success))
        if ids is not None:
            where.append(f"id IN ({','.join('?' * len(ids))})")
            args.extend(ids)
        sql = ("SELECT * FROM trajectories" + (" WHERE " + " AND ".join(where) if where else "")
               + " ORDER BY (SELECT MIN(f.id) FROM trajectories AS f WHERE f.collection = trajectories.collection), slot")
        with self._lock:
            self._db.row_factory = sqlite3.Row
            try:
                rows = self._db.execute(sql, args).fetchall()
                out = []
                for row in rows:
                    steps = self._db.execute("SELECT * FROM steps WHERE traj_id = ? ORDER BY t", (row["id"],)).fetchall()
                    out.append(self._trajectory(row, steps))
            finally:
                self._db.row_factory = None
        return out

    @staticmethod
    def _trajectory(row: Any, steps: list[Any]) -> Trajectory:
        meta = json.loads(row["meta_json"])
        meta.update(store_id=row["id"], collection=row["collection"], slot=row["slot"])
        return Trajectory(
            task=Task.from_dict(json.loads(row["task_json"])),
            source=row["source"],
            policy_id=row["policy_id"],
            instruction=row["instruction"],
            steps=[
                Step(
                    t=s["t"], obs=s["obs"], action_text=s["action_text"], action_ids=_ints(s["action_ids"]),
                    logprobs=_floats(s["logprobs"]), parsed_action=s["parsed_action"], next_obs=s["next_obs"],
                    reward=s["reward"], done=bool(s["done"]), score=s["score"], signal=s["signal"],
                    info=json.loads(s["info_json"]),
                )
                for s in steps
            ],
            final_reward=row["final_reward"],
            success=bool(row["success"]),
            goal=row["goal"],
            meta=meta,
        )

    def search_goals(self, text: str, limit: int = 50) -> list[int]:
        """Ids of trajectories whose goal shares words with text (full-text index, best match first)."""
        words = sorted(content_words(text))
        if not words:
            return []
        query = " OR ".join(f'"{w}"' for w in words)
        with self._lock:
            rows = self._db.execute(
                "SELECT rowid FROM goals WHERE goals MATCH ? ORDER BY rank LIMIT ?", (query, limit)
            ).fetchall()
        return [int(r[0]) for r in rows]

    def export_jsonl(self, path: str | Path, collection: str | None = None) -> int:
        """Write trajectories (steps included) as JSON lines; returns how many."""
        n = 0
        with replacing(path) as tmp, open(tmp, "w") as fh:
            for traj in self.load(collection=collection):
                record = {
                    "task": traj.task.to_dict(), "source": traj.source, "policy_id": traj.policy_id,
                    "instruction": traj.instruction, "goal": traj.goal, "final_reward": traj.final_reward,
                    "success": traj.success, "meta": traj.meta, "steps": [s.to_dict() for s in traj.steps],
                }
                fh.write(json.dumps(record, default=str) + "\n")
                n += 1
        return n
