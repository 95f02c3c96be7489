"""Data out and in: stored trajectories as TRL/verl-style rows (messages, prompt/completion, chosen/rejected, steps)
and trajectories from files (our `steps` rows, our trajectory JSONL, the plain trajectory format of docs/data.md).

The chat columns are the messages agentevo renders prompts from (agent/prompt.py build_messages): the instruction
and first observation in the first user turn, each reply as an assistant turn, each next observation as a user turn
"Observation: ...". Rows are plain dicts; write_rows() stores them as JSON lines or Parquet (the `export` extra).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agentevo.agent.prompt import HistoryTurn, build_messages, parse_action
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task, classify_signal
from agentevo.errors import AgentevoError, MissingDependencyError
from agentevo.files import replacing

KINDS = ("messages", "prompt_completion", "preference", "steps")
FORMATS = ("parquet", "jsonl")
# Imported trajectories without a slot of their own are numbered from here, so they never take the slot of a
# trajectory the run itself collects later (the expert demo of training task k is slot k of "expert").
IMPORT_SLOT_BASE = 1_000_000
_STORE_META = ("store_id", "collection", "slot")

# -- rows out ------------------------------------------------------------------------------------------------------


def _common(traj: Trajectory) -> dict[str, Any]:
    """The columns every row of a trajectory carries (who acted, on which task, with what outcome)."""
    t = traj.task
    return {
        "collection": traj.meta.get("collection"), "slot": traj.meta.get("slot"), "task_id": t.task_id,
        "env": t.env, "split": t.split, "task_type": t.task_type, "source": traj.source,
        "policy_id": traj.policy_id, "success": traj.success, "final_reward": traj.final_reward,
        "n_steps": traj.length,
    }


def step_messages(traj: Trajectory, t: int, window: int | None = None) -> list[dict[str, str]]:
    """The chat the policy saw before its reply at step t (1-based): build_messages with the replies as text.

    window None keeps every earlier turn (the whole episode); otherwise the run's agent.history_window.
    """
    earlier = traj.steps[: t - 1]
    w = len(earlier) if window is None else window
    history = [HistoryTurn([], s.next_obs) for s in earlier]
    messages = build_messages(traj.instruction, traj.goal, traj.first_obs, history, w,
                              prefix=str(traj.meta.get("prefix", "") or ""))
    kept = min(w, len(earlier)) if w > 0 else 0  # build_messages keeps the last `w` turns
    replies = iter(earlier[len(earlier) - kept :])
    return [{"role": m.role, "content": next(replies).action_text if m.role == "assistant" else m.text}
            for m in messages]


def conversation(traj: Trajectory, window: int | None = None) -> list[dict[str, str]]:
    """The last step's prompt plus its reply: with the whole episode in the window, the full chat."""
    if not traj.steps:
        return step_messages(traj, 1, window)
    return [*step_messages(traj, traj.length, window), {"role": "assistant", "content": traj.steps[-1].action_text}]


def messages_rows(trajs: Iterable[Trajectory], window: int | None = None) -> list[dict[str, Any]]:
    """TRL `messages` rows: one per trajectory when the window holds the whole episode (every reply then sits in the
    very context it was produced in), else one per step (its windowed prompt and reply); `step` is None or t."""
    rows = []
    for traj in trajs:
        if not traj.steps:
            continue
        if window is None or window >= traj.length - 1:
            rows.append({**_common(traj), "step": None, "messages": conversation(traj, None)})
            continue
        for s in traj.steps:
            chat = [*step_messages(traj, s.t, window), {"role": "assistant", "content": s.action_text}]
            rows.append({**_common(traj), "step": s.t, "messages": chat})
    return rows


def prompt_completion_rows(trajs: Iterable[Trajectory], window: int | None = None) -> list[dict[str, Any]]:
    """TRL conversational prompt/completion rows, one per step, with that step's reward, score and signal."""
    rows = []
    for traj in trajs:
        for s in traj.steps:
            rows.append({
                **_common(traj), "step": s.t, "prompt": step_messages(traj, s.t, window),
                "completion": [{"role": "assistant", "content": s.action_text}],
                "reward": s.reward, "score": s.score, "done": s.done, "signal": s.signal,
            })
    return rows


def preference_rows(expert: Iterable[Trajectory], agent: Iterable[Trajectory],
                    extra_turns: int | None) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """ETO's trajectory pairs (algorithms/eto.py preference_pairs) as TRL conversational preference rows:
    prompt = the first user turn (instruction + first observation), chosen / rejected = the rest of each chat."""
    from agentevo.algorithms.eto import preference_pairs  # imports torch: only when pairs are asked for

    pairs, counts = preference_pairs({t.task.task_id: t for t in expert}, list(agent), extra_turns)
    rows = []
    for p in pairs:
        chosen, rejected = conversation(p.chosen), conversation(p.rejected)
        t = p.chosen.task
        rows.append({
            "task_id": p.task_id, "env": t.env, "split": t.split, "task_type": t.task_type, "kind": p.kind,
            "prompt": chosen[:1], "chosen": chosen[1:], "rejected": rejected[1:],
            "chosen_source": p.chosen.source, "rejected_source": p.rejected.source,
            "chosen_policy_id": p.chosen.policy_id, "rejected_policy_id": p.rejected.policy_id,
            "chosen_reward": p.chosen.final_reward, "rejected_reward": p.rejected.final_reward,
            "chosen_collection": p.chosen.meta.get("collection"), "rejected_collection": p.rejected.meta.get("collection"),
            "rejected_steps": p.rejected.length,
        })
    return rows, counts


def steps_rows(trajs: Iterable[Trajectory],
               advantages: dict[int, tuple[int, list[float]]] | None = None) -> list[dict[str, Any]]:
    """One row per step with everything the store holds (import_rows() rebuilds the trajectories from them), plus
    Q-Evolve's stored advantage A_t where a labels file covers the trajectory."""
    rows = []
    for traj in trajs:
        meta = {k: v for k, v in traj.meta.items() if k not in _STORE_META}
        adv = (advantages or {}).get(int(traj.meta.get("store_id", -1)))
        for s in traj.steps:
            rows.append({
                **_common(traj), "task_json": json.dumps(traj.task.to_dict()), "instruction": traj.instruction,
                "goal": traj.goal, "meta_json": json.dumps(meta, default=str), "t": s.t, "obs": s.obs,
                "action_text": s.action_text, "action_ids": list(s.action_ids), "logprobs": s.logprobs,
                "parsed_action": s.parsed_action, "next_obs": s.next_obs, "reward": s.reward, "done": s.done,
                "score": s.score, "signal": s.signal, "info_json": json.dumps(s.info, default=str),
                "advantage": None if adv is None else adv[1][s.t - 1],
                "advantage_round": None if adv is None else adv[0],
            })
    return rows


def stored_advantages(run_dir: Path) -> dict[int, tuple[int, list[float]]]:
    """Q-Evolve's normalised advantages (labels/round-R.json) by trajectory store id: the latest round's."""
    out: dict[int, tuple[int, list[float]]] = {}
    files = sorted(run_dir.glob("labels/round-*.json"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    for path in files:
        r = int(re.sub(r"\D", "", path.stem) or 0)
        data = json.loads(path.read_text())
        for key, adv in zip(data.get("keys", []), data.get("adv", []), strict=False):
            out[int(key)] = (r, [float(a) for a in adv])
    return out


# -- files ---------------------------------------------------------------------------------------------------------


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ModuleNotFoundError as exc:
        raise MissingDependencyError(
            "Parquet needs pyarrow: pip install 'agentevo[export]', or use --format jsonl") from exc
    return pyarrow


def write_rows(rows: list[dict[str, Any]], path: Path, fmt: str) -> Path:
    """Write rows as JSON lines or Parquet, atomically (temp file + rename); returns the path."""
    if fmt not in FORMATS:
        raise AgentevoError(f"unknown export format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    with replacing(path) as tmp:
        if fmt == "jsonl":
            with open(tmp, "w") as fh:
                for row in rows:
                    fh.write(json.dumps(row, default=str) + "\n")
        else:
            pa = _pyarrow()
            pa.parquet.write_table(pa.Table.from_pylist(rows), tmp)
    return path


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a .parquet file, or the JSON objects of a JSON-lines file (one per line)."""
    if not path.exists():
        raise AgentevoError(f"{str(path)!r} does not exist; give a .jsonl or .parquet file")
    if path.suffix == ".parquet":
        return list(_pyarrow().parquet.read_table(path).to_pylist())
    rows = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise AgentevoError(f"{path}:{n} is not JSON ({exc.msg}); each line must be one JSON object") from exc
            if not isinstance(row, dict):
                raise AgentevoError(f"{path}:{n} is not a JSON object; each line must be one trajectory or step row")
            rows.append(row)
    return rows


# -- rows in -------------------------------------------------------------------------------------------------------


def _meta_fields(meta: dict[str, Any]) -> tuple[dict[str, Any], str | None, int | None]:
    slot = meta.get("slot")
    return ({k: v for k, v in meta.items() if k not in _STORE_META}, meta.get("collection"),
            None if slot is None else int(slot))


def _from_steps_rows(rows: list[dict[str, Any]]) -> list[tuple[str | None, int | None, Trajectory]]:
    """Our `steps` rows, grouped back into trajectories by (collection, slot, task) in file order."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row.get("collection"), row.get("slot"), row["task_json"], row.get("policy_id")), []).append(row)
    out = []
    for (collection, slot, _, _), group in groups.items():
        group.sort(key=lambda r: int(r["t"]))
        first = group[0]
        meta = json.loads(first.get("meta_json") or "{}")
        steps = [Step(
            t=int(r["t"]), obs=r["obs"], action_text=r["action_text"], action_ids=[int(i) for i in r["action_ids"] or []],
            logprobs=None if r.get("logprobs") is None else [float(x) for x in r["logprobs"]],
            parsed_action=r.get("parsed_action"), next_obs=r["next_obs"], reward=float(r["reward"]),
            done=bool(r["done"]), score=float(r["score"]), signal=r["signal"],
            info=json.loads(r.get("info_json") or "{}"),
        ) for r in group]
        traj = Trajectory(task=Task.from_dict(json.loads(first["task_json"])), source=first["source"],
                          policy_id=first["policy_id"], instruction=first["instruction"], steps=steps,
                          final_reward=float(first["final_reward"]), success=bool(first["success"]),
                          goal=first.get("goal") or "", meta=meta)
        out.append((collection, None if slot is None else int(slot), traj))
    return out


def _reply_text(step: dict[str, Any]) -> str:
    """The assistant message of a plain step: action_text as given, an 'Action:' reply as given, else built."""
    if "action_text" in step:
        return str(step["action_text"])
    action = str(step.get("action", ""))
    if parse_action(action) is not None:
        return action
    thought = step.get("thought")
    return f"Thought: {thought}\nAction: {action}" if thought else f"Action: {action}"


def _plain_step(step: dict[str, Any], t: int, next_step: dict[str, Any] | None, score: float,
                where: str) -> Step:
    obs = step.get("obs", step.get("observation"))
    if obs is None:
        raise AgentevoError(f"{where}: step {t} has no 'observation'; every step needs the text the agent saw")
    if "action" not in step and "action_text" not in step:
        raise AgentevoError(f"{where}: step {t} has no 'action'; give the command (or the whole reply as action_text)")
    nxt = step.get("next_obs", step.get("next_observation"))
    if nxt is None:
        nxt = "" if next_step is None else next_step.get("obs", next_step.get("observation", ""))
    text = _reply_text(step)
    parsed = parse_action(text)
    return Step(
        t=t, obs=str(obs), action_text=text, action_ids=[int(i) for i in step.get("action_ids") or []],
        logprobs=None if step.get("logprobs") is None else [float(x) for x in step["logprobs"]],
        parsed_action=step.get("parsed_action", parsed), next_obs=str(nxt), reward=float(step.get("reward", 0.0)),
        done=bool(step.get("done", False)), score=float(step.get("score", score)),
        signal=str(step.get("signal") or classify_signal(str(obs), str(nxt), parsed is not None, ())),
        info=dict(step.get("info") or {}),
    )


def _task(record: dict[str, Any], n_steps: int, default_env: str | None, where: str) -> Task:
    if isinstance(record.get("task"), dict):
        fields = dict(record["task"])
    else:
        fields = {k: record[k] for k in ("env", "task_id", "split", "task_type", "params", "max_steps") if k in record}
    if "task_id" not in fields:
        raise AgentevoError(f"{where}: no task_id; give 'task_id' (or a 'task' object) for every trajectory")
    env = fields.get("env") or default_env
    if not env:
        raise AgentevoError(f"{where}: no 'env'; name the environment the trajectory was played in")
    return Task(env=str(env), task_id=str(fields["task_id"]), split=str(fields.get("split", "train")),
                task_type=str(fields.get("task_type") or "imported"), params=dict(fields.get("params") or {}),
                max_steps=int(fields.get("max_steps") or max(50, n_steps)))


def trajectory_from_record(record: dict[str, Any], default_env: str | None = None,
                           where: str = "record") -> tuple[str | None, int | None, Trajectory]:
    """A trajectory from one plain-format object (docs/data.md) or one line of our trajectory JSONL; with the
    collection and slot it names in its meta (None when it names none)."""
    steps_in = record.get("steps")
    if not isinstance(steps_in, list):
        raise AgentevoError(f"{where}: no 'steps' list; see docs/data.md for the trajectory format")
    instruction = record.get("instruction")
    if not isinstance(instruction, str):
        raise AgentevoError(f"{where}: no 'instruction'; give the task-independent instruction the agent was shown")
    task = _task(record, len(steps_in), default_env, where)
    steps, score = [], 0.0
    for k, raw in enumerate(steps_in):
        if not isinstance(raw, dict):
            raise AgentevoError(f"{where}: step {k + 1} is not a JSON object")
        score += float(raw.get("reward", 0.0))
        steps.append(_plain_step(raw, int(raw.get("t", k + 1)), steps_in[k + 1] if k + 1 < len(steps_in) else None,
                                 score, where))
    final = record.get("final_reward")
    final = float(final) if final is not None else (steps[-1].score if steps else 0.0)
    success = record.get("success")
    meta, collection, slot = _meta_fields(dict(record.get("meta") or {}))
    traj = Trajectory(task=task, source=str(record.get("source") or "expert"),
                      policy_id=str(record.get("policy_id") or "imported"), instruction=instruction, steps=steps,
                      final_reward=final, success=bool(final >= 1.0) if success is None else bool(success),
                      goal=str(record.get("goal") or ""), meta=meta)
    return collection, slot, traj


def import_rows(rows: list[dict[str, Any]], default_env: str | None = None,
                where: str = "file") -> list[tuple[str | None, int | None, Trajectory]]:
    """Trajectories from rows of one file: our `steps` rows, or one trajectory object per row."""
    if not rows:
        raise AgentevoError(f"{where} holds no rows")
    first = rows[0]
    if "task_json" in first and "action_text" in first:
        return _from_steps_rows(rows)
    if "steps" in first:
        return [trajectory_from_record(r, default_env, f"{where}:{n}") for n, r in enumerate(rows, 1)]
    kind = next((k for k in ("messages", "prompt", "chosen") if k in first), None)
    if kind is not None:
        raise AgentevoError(
            f"{where} holds {kind!r} rows, which lack the observations a trajectory needs; import the `steps` export "
            "(agentevo export --kind steps) or the trajectory format of docs/data.md")
    raise AgentevoError(f"{where}: rows have neither 'steps' nor 'task_json'; see docs/data.md for the formats")


def store_imported(store: Any, items: list[tuple[str | None, int | None, Trajectory]], collection: str | None,
                   source: str | None, drop_ids: bool = False) -> dict[str, int]:
    """Add imported trajectories to a store; returns how many went into each collection.

    With `collection`, everything goes there under fresh slots (from IMPORT_SLOT_BASE, after any slot already
    used). Without it, a trajectory that names its collection and slot (our own exports) keeps both and is skipped
    when that slot is already stored (importing the same file twice adds nothing); one that names none goes to
    'expert' under a fresh slot. `source` replaces every trajectory's source. drop_ids stores the replies as text
    only (no token ids, no log-probs), to be tokenised by the training policy like expert demos.
    """
    counts: dict[str, int] = {}
    used: dict[str, set[int]] = {}
    for coll, slot, traj in items:
        if source:
            traj.source = source
        if drop_ids:
            for step in traj.steps:
                step.action_ids, step.logprobs = [], None
        target = collection or coll or "expert"
        taken = used.setdefault(target, store.done_slots(target))
        if collection is None and coll is not None and slot is not None:
            if slot in taken:
                continue
        else:
            slot = max(IMPORT_SLOT_BASE - 1, *taken) + 1 if taken else IMPORT_SLOT_BASE
        store.add(traj, target, slot)
        taken.add(slot)
        counts[target] = counts.get(target, 0) + 1
    return counts


# -- the commands --------------------------------------------------------------------------------------------------


def _run_settings(run_dir: Path) -> dict[str, Any]:
    """The settings of a run folder's config.yaml that shape its prompts and ETO pairs (defaults when absent)."""
    import yaml

    from agentevo.algorithms.baselines_config import ETOConfig
    from agentevo.config import AgentConfig

    path = run_dir / "config.yaml"
    cfg = (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
    agent, eto, env = cfg.get("agent") or {}, cfg.get("eto") or {}, cfg.get("env") or {}
    return {
        "window": int(agent.get("history_window", AgentConfig().history_window)),
        "extra_turns": eto.get("rejected_extra_turns", ETOConfig().rejected_extra_turns),
        "env": env.get("name"),
    }


def export_run(run_dir: Path, fmt: str, kinds: list[str], collections: list[str] | None,
               out: Path) -> list[tuple[str, int, Path | None]]:
    """`agentevo export`: the chosen kinds of rows of a run's store, one file per kind; (kind, rows, path)."""
    from agentevo.data.store import ExperienceStore

    db = run_dir / "experience.db"
    if not db.exists():
        raise AgentevoError(f"{str(run_dir)!r} is not a run folder (no experience.db); give runs/NAME")
    for kind in kinds:
        if kind not in KINDS:
            raise AgentevoError(f"unknown export kind {kind!r}; choose from: {', '.join(KINDS)}")
    if fmt not in FORMATS:
        raise AgentevoError(f"unknown export format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    if fmt == "parquet":
        _pyarrow()  # fail before any work
    settings = _run_settings(run_dir)
    store = ExperienceStore(db)
    try:
        present = store.collections()
        missing = [c for c in collections or [] if c not in present]
        if missing:
            raise AgentevoError(f"run {run_dir} has no collection {missing[0]!r}; its collections are: "
                                f"{', '.join(present) or '(none)'}")
        chosen = collections or present
        trajs = [t for c in chosen for t in store.load(collection=c)]
        written = []
        for kind in kinds:
            if kind == "messages":
                rows = messages_rows(trajs, settings["window"])
            elif kind == "prompt_completion":
                rows = prompt_completion_rows(trajs, settings["window"])
            elif kind == "steps":
                rows = steps_rows(trajs, stored_advantages(run_dir))
            else:
                # ETO pairs each agent trajectory with the expert demo of its task; by default every collection
                # but the demos themselves and the evaluations is an agent's exploration.
                agent = [t for t in trajs if t.meta.get("collection") != "expert"
                         and (collections or not str(t.meta.get("collection", "")).startswith("eval/"))]
                rows, _ = preference_rows(store.load(collection="expert"), agent, settings["extra_turns"])
            path = write_rows(rows, out / f"{kind}.{fmt}", fmt) if rows else None
            written.append((kind, len(rows), path))
    finally:
        store.close()
    return written


def import_file(path: Path, run_dir: Path, collection: str | None, source: str | None,
                drop_ids: bool = False) -> dict[str, int]:
    """`agentevo import`: trajectories from a file into a run's store (the folder is made if new)."""
    from agentevo.data.store import ExperienceStore
    from agentevo.run import RunLock

    items = import_rows(read_rows(path), _run_settings(run_dir)["env"], where=str(path))
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(run_dir)  # never write a store that a running train/resume owns
    try:
        store = ExperienceStore(run_dir / "experience.db")
        try:
            return store_imported(store, items, collection, source, drop_ids)
        finally:
            store.close()
    finally:
        lock.release()
