"""`agentevo export` / `agentevo import`: TRL-shaped rows from stored trajectories, and trajectories back in."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from agentevo.cli import main
from agentevo.data import export as ex
from agentevo.data.store import ExperienceStore
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.errors import AgentevoError

INSTR = "Cook a meal."


def _traj(task_id: str, source: str, actions: list[str], final: float, ids: bool = True,
          prefix: str = "") -> Trajectory:
    task = Task("twx-cookingworld", task_id, "train", "cook", {"seed": 3}, 10)
    steps = [Step(t=k + 1, obs=f"o{k + 1}", action_text=f"Thought: t{k + 1}\nAction: {a}",
                  action_ids=[10 + k, 20 + k] if ids else [], logprobs=[-0.5, -1.25] if ids else None,
                  parsed_action=a, next_obs=f"o{k + 2}", reward=0.25 * k, done=k == len(actions) - 1,
                  score=0.5 * k, signal="repeat" if k == 1 else "none", info={"success": False, "aux": k})
             for k, a in enumerate(actions)]
    return Trajectory(task, source, "bc" if ids else "expert", INSTR, steps, final, final >= 1.0, goal="cook",
                      meta={"retries": 0, "prefix": prefix})


def _run(tmp_path: Path) -> Path:
    """A run folder whose store holds expert demos, an ETO exploration and an evaluation."""
    run = tmp_path / "src"
    run.mkdir()
    (run / "config.yaml").write_text("env: {name: twx-cookingworld}\nagent: {history_window: 2}\n"
                                     "eto: {rejected_extra_turns: 1}\n")
    store = ExperienceStore(run / "experience.db")
    store.add(_traj("a", "expert", ["open fridge", "take egg"], 1.0, ids=False), "expert", 0)
    store.add(_traj("b", "expert", ["take knife"], 1.0, ids=False), "expert", 1)
    store.add(_traj("a", "self", ["look", "look", "go east", "go west"], 0.0), "eto/iter-1/explore", 0)
    store.add(_traj("b", "self", ["take knife"], 1.0), "eto/iter-1/explore", 1)  # tie with its expert: no pair
    store.add(_traj("a", "self", ["open fridge"], 0.0, prefix="Hint: eggs.\n"), "eval/bc/test", 0)
    store.close()
    return run


def test_messages_are_the_prompts_agentevo_renders() -> None:
    traj = _traj("a", "self", ["open fridge", "take egg", "eat egg"], 1.0, prefix="Hint.\n")
    full = ex.conversation(traj)
    assert full == [
        {"role": "user", "content": "Cook a meal.\n\nHint.\n\no1"},
        {"role": "assistant", "content": "Thought: t1\nAction: open fridge"},
        {"role": "user", "content": "Observation: o2"},
        {"role": "assistant", "content": "Thought: t2\nAction: take egg"},
        {"role": "user", "content": "Observation: o3"},
        {"role": "assistant", "content": "Thought: t3\nAction: eat egg"},
    ]
    # window 2 holds the whole 3-step episode (2 earlier turns at most): one row
    rows = ex.messages_rows([traj], window=2)
    assert len(rows) == 1 and rows[0]["messages"] == full and rows[0]["step"] is None
    # window 1 drops turns: one row per step, the first message restating goal and observation as build_messages does
    rows = ex.messages_rows([traj], window=1)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["messages"] == [
        {"role": "user", "content": "Cook a meal.\n\nHint.\n\nGoal: cook\n(1 earlier steps omitted.)\nObservation: o2"},
        {"role": "assistant", "content": "Thought: t2\nAction: take egg"},
        {"role": "user", "content": "Observation: o3"},
        {"role": "assistant", "content": "Thought: t3\nAction: eat egg"},
    ]
    pc = ex.prompt_completion_rows([traj], window=0)
    assert pc[1]["prompt"] == [
        {"role": "user", "content": "Cook a meal.\n\nHint.\n\nGoal: cook\n(1 earlier steps omitted.)\nObservation: o2"}]
    assert pc[1]["completion"] == [{"role": "assistant", "content": "Thought: t2\nAction: take egg"}]
    assert (pc[1]["reward"], pc[1]["score"], pc[1]["signal"], pc[2]["done"]) == (0.25, 0.5, "repeat", True)
    assert {k: pc[0][k] for k in ("task_id", "env", "split", "source", "policy_id", "success", "final_reward")} == {
        "task_id": "a", "env": "twx-cookingworld", "split": "train", "source": "self", "policy_id": "bc",
        "success": True, "final_reward": 1.0}


def test_preference_rows_are_etos_pairs() -> None:
    expert = [_traj("a", "expert", ["open fridge", "take egg"], 1.0, ids=False),
              _traj("b", "expert", ["take knife", "slice"], 0.5, ids=False)]
    agent = [_traj("a", "self", ["look"] * 6, 0.0),  # lose: expert chosen, agent cut to 2 + 1 turns
             _traj("b", "self", ["take knife"], 1.0),  # win: agent chosen
             _traj("c", "self", ["look"], 0.0)]  # no expert
    rows, counts = ex.preference_rows(expert, agent, extra_turns=1)
    assert counts == {"win": 1, "tie": 0, "lose": 1, "no_expert": 1}
    lose, win = rows
    assert (lose["kind"], lose["chosen_source"], lose["rejected_steps"], win["kind"]) == ("lose", "expert", 3, "win")
    assert lose["prompt"] == [{"role": "user", "content": "Cook a meal.\n\no1"}]
    assert [m["role"] for m in lose["rejected"]] == ["assistant", "user", "assistant", "user", "assistant"]
    assert lose["chosen"][-1] == {"role": "assistant", "content": "Thought: t2\nAction: take egg"}
    assert (win["chosen_reward"], win["rejected_reward"], win["chosen_policy_id"]) == (1.0, 0.5, "bc")


def test_steps_rows_carry_ids_logprobs_and_stored_advantages(tmp_path: Path) -> None:
    run = _run(tmp_path)
    (run / "labels").mkdir()
    (run / "labels" / "round-1.json").write_text(json.dumps({"keys": [3], "adv": [[0.1, 0.2, 0.3, 0.4]]}))
    (run / "labels" / "round-2.json").write_text(json.dumps({"keys": [3], "adv": [[1.0, 2.0, 3.0, 4.0]]}))
    store = ExperienceStore(run / "experience.db")
    trajs = store.load(collection="eto/iter-1/explore")
    store.close()
    rows = ex.steps_rows(trajs, ex.stored_advantages(run))
    assert len(rows) == 5
    assert (rows[2]["action_ids"], rows[2]["logprobs"], rows[2]["advantage"], rows[2]["advantage_round"]) == (
        [12, 22], [-0.5, -1.25], 3.0, 2)
    assert rows[4]["advantage"] is None and json.loads(rows[1]["info_json"]) == {"success": False, "aux": 1}


def _compare(a: list[Trajectory], b: list[Trajectory]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        mx = {k: v for k, v in x.meta.items() if k != "store_id"}
        my = {k: v for k, v in y.meta.items() if k != "store_id"}
        assert dataclasses.replace(x, meta=mx) == dataclasses.replace(y, meta=my)
        assert x.task.to_dict() == y.task.to_dict()  # Task equality ignores params


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_round_trip_through_steps_files(tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    run = _run(tmp_path)
    assert main(["export", str(run), "--format", fmt, "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert f"steps                    9 rows  {tmp_path / 'out' / f'steps.{fmt}'}" in printed
    assert "preference               1 rows" in printed  # a lose pair; the tie of task b is dropped
    target = tmp_path / "dst"
    assert main(["import", str(tmp_path / "out" / f"steps.{fmt}"), "--into", str(target)]) == 0
    assert "imported 5 trajectories" in capsys.readouterr().out
    src, dst = ExperienceStore(run / "experience.db"), ExperienceStore(target / "experience.db")
    try:
        assert src.collections() == dst.collections()
        for c in src.collections():
            _compare(src.load(collection=c), dst.load(collection=c))
        # the same file again adds nothing: each trajectory keeps its (collection, slot)
        assert main(["import", str(tmp_path / "out" / f"steps.{fmt}"), "--into", str(target)]) == 0
        assert dst.count() == 5
    finally:
        src.close()
        dst.close()


def test_round_trip_through_the_stores_trajectory_jsonl(tmp_path: Path) -> None:
    run = _run(tmp_path)
    src = ExperienceStore(run / "experience.db")
    try:
        src.export_jsonl(tmp_path / "trajs.jsonl")
        counts = ex.import_file(tmp_path / "trajs.jsonl", tmp_path / "dst", None, None)
        assert counts == {"expert": 2, "eto/iter-1/explore": 2, "eval/bc/test": 1}
        dst = ExperienceStore(tmp_path / "dst" / "experience.db")
        _compare(src.load(), dst.load())
        dst.close()
        # --drop-ids: the same trajectories with text-only replies, for a run whose tokenizer differs
        assert main(["import", str(tmp_path / "trajs.jsonl"), "--into", str(tmp_path / "text"), "--drop-ids"]) == 0
        text = ExperienceStore(tmp_path / "text" / "experience.db")
        stripped = [dataclasses.replace(t, steps=[dataclasses.replace(s, action_ids=[], logprobs=None)
                                                  for s in t.steps]) for t in src.load()]
        _compare(stripped, text.load())
        assert any(s.action_ids for t in src.load() for s in t.steps)
        text.close()
    finally:
        src.close()


PLAIN = [
    {"task_id": "x1", "env": "webshop", "task_type": "buy", "instruction": "Shop.", "goal": "buy a hat",
     "steps": [{"observation": "home", "action": "search[hat]", "thought": "find it", "reward": 0.0},
               {"observation": "results", "action": "click[hat]", "reward": 0.0},
               {"observation": "hat page", "action": "Thought: ok\nAction: buy now", "reward": 1.0, "done": True,
                "next_observation": "bought"}]},
    {"task": {"env": "webshop", "task_id": "x2", "split": "train", "task_type": "buy", "params": {"i": 2},
              "max_steps": 9}, "instruction": "Shop.", "final_reward": 0.5, "source": "self", "policy_id": "gpt",
     "steps": [{"observation": "home", "action": "dance", "next_observation": "home"},
               {"observation": "home", "action_text": "no idea", "next_observation": "Invalid format."}]},
]


def test_plain_trajectories_import_as_text_replies_and_train_like_expert_demos(tmp_path: Path, tiny_policy) -> None:  # noqa: ANN001
    path = tmp_path / "plain.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PLAIN))
    assert main(["import", str(path), "--into", str(tmp_path / "r")]) == 0
    store = ExperienceStore(tmp_path / "r" / "experience.db")
    a, b = store.load(collection="expert")
    store.close()
    assert (a.meta["slot"], b.meta["slot"]) == (ex.IMPORT_SLOT_BASE, ex.IMPORT_SLOT_BASE + 1)
    assert [s.action_text for s in a.steps] == ["Thought: find it\nAction: search[hat]", "Action: click[hat]",
                                                "Thought: ok\nAction: buy now"]
    assert [s.parsed_action for s in a.steps] == ["search[hat]", "click[hat]", "buy now"]
    assert [s.next_obs for s in a.steps] == ["results", "hat page", "bought"]
    assert [s.score for s in a.steps] == [0.0, 0.0, 1.0]
    assert (a.final_reward, a.success, a.source, a.policy_id, a.task.max_steps) == (1.0, True, "expert", "imported", 50)
    assert all(s.action_ids == [] and s.logprobs is None for s in a.steps)
    assert (b.final_reward, b.success, b.source, b.task.params, b.task.max_steps) == (0.5, False, "self", {"i": 2}, 9)
    assert [s.signal for s in b.steps] == ["repeat", "format"] and b.steps[1].parsed_action is None
    # token ids come from the training policy's tokenizer, as for the env's own expert demos
    from agentevo.algorithms.bc import expert_samples

    samples = expert_samples(tiny_policy, [a], window=5, max_length=4096)
    assert a.steps[0].action_ids == tiny_policy.renderer.encode_reply(a.steps[0].action_text)
    assert sum(s.n_action_tokens for s in samples) == sum(len(s.action_ids) for s in a.steps)
    # --collection and --source put a second import under fresh slots after the first
    assert main(["import", str(path), "--into", str(tmp_path / "r"), "--collection", "expert", "--source", "gold"]) == 0
    store = ExperienceStore(tmp_path / "r" / "experience.db")
    again = store.load(collection="expert")
    store.close()
    assert [t.meta["slot"] for t in again] == [ex.IMPORT_SLOT_BASE + k for k in range(4)]
    assert [t.source for t in again] == ["expert", "self", "gold", "gold"]


def test_bad_input_gives_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    assert main(["export", str(run), "--format", "jsonl", "--kind", "messages", "--out", str(tmp_path / "o")]) == 0
    assert main(["import", str(tmp_path / "o" / "messages.jsonl"), "--into", str(tmp_path / "d")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "holds 'messages' rows, which lack the observations a trajectory needs; import the `steps` export "
        "(agentevo export --kind steps) or the trajectory format of docs/data.md")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": "x", "env": "e", "steps": []}) + "\n")
    with pytest.raises(AgentevoError, match=r"bad.jsonl:1: no 'instruction'; give the task-independent instruction"):
        ex.import_file(bad, tmp_path / "d", None, None)
    assert main(["export", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"error: {str(tmp_path / 'nope')!r} is not a run folder (no experience.db); " \
                                      "give runs/NAME\n"
    assert main(["export", str(run), "--format", "jsonl", "--collection", "round-1/self"]) == 2
    assert "has no collection 'round-1/self'; its collections are: expert, eto/iter-1/explore, eval/bc/test" in \
        capsys.readouterr().err


def test_datasets_loads_the_exported_files(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("pyarrow")
    run = _run(tmp_path)
    for fmt in ("jsonl", "parquet"):
        ex.export_run(run, fmt, list(ex.KINDS), None, tmp_path / fmt)
    loader = {"jsonl": "json", "parquet": "parquet"}
    for fmt in ("jsonl", "parquet"):
        msgs = datasets.load_dataset(loader[fmt], data_files=str(tmp_path / fmt / f"messages.{fmt}"), split="train")
        assert msgs.num_rows == 8 and msgs[0]["messages"][0] == {"role": "user", "content": "Cook a meal.\n\no1"}
        pref = datasets.load_dataset(loader[fmt], data_files=str(tmp_path / fmt / f"preference.{fmt}"), split="train")
        assert pref.column_names[:8] == ["task_id", "env", "split", "task_type", "kind", "prompt", "chosen", "rejected"]
        steps = datasets.load_dataset(loader[fmt], data_files=str(tmp_path / fmt / f"steps.{fmt}"), split="train")
        assert steps.num_rows == 9 and steps[3]["action_ids"] == [10, 20]


def test_import_refuses_a_run_folder_another_process_owns(tmp_path: Path) -> None:
    from agentevo.errors import AgentevoError
    from agentevo.run import RunLock

    run = _run(tmp_path)
    src = ExperienceStore(run / "experience.db")
    try:
        src.export_jsonl(tmp_path / "trajs.jsonl")
    finally:
        src.close()
    (tmp_path / "busy").mkdir()
    owner = RunLock(tmp_path / "busy")  # as a running `agentevo train --name busy` holds it
    try:
        with pytest.raises(AgentevoError, match="is in use by pid"):
            ex.import_file(tmp_path / "trajs.jsonl", tmp_path / "busy", None, None)
        assert not (tmp_path / "busy" / "experience.db").exists()
    finally:
        owner.release()
    assert ex.import_file(tmp_path / "trajs.jsonl", tmp_path / "busy", None, None)["expert"] == 2
