"""Atomic writes: a file or folder is replaced whole or left as it was; nothing half-written or stray remains."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentevo.files import finish_interrupted_swap, replacing, replacing_dir, write_text_atomic


class Boom(Exception):
    pass


def test_write_text_atomic_creates_parents_and_replaces(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "state.json"
    assert write_text_atomic(path, "one") == path
    write_text_atomic(path, "two")
    assert path.read_text() == "two"
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "material.json"
    path.write_text('{"round": 1}')
    with pytest.raises(Boom), replacing(path) as tmp:
        tmp.write_text('{"rou')  # cut off mid-write
        raise Boom
    assert path.read_text() == '{"round": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["material.json"]


def test_replacing_dir_swaps_a_folder_whole(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with replacing_dir(path) as tmp:
        (tmp / "weights").write_text("v1")
        assert not path.exists()  # nothing is visible until the block ends
    with replacing_dir(path) as tmp:
        (tmp / "weights").write_text("v2")
        assert (path / "weights").read_text() == "v1"  # the previous folder is whole meanwhile
    assert sorted(p.name for p in path.iterdir()) == ["weights"] and (path / "weights").read_text() == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_replacing_dir_keeps_the_old_folder_when_the_block_fails(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with replacing_dir(path) as tmp:
        (tmp / "weights").write_text("v1")
    with pytest.raises(Boom), replacing_dir(path) as tmp:
        (tmp / "weights").write_text("half")
        raise Boom
    assert (path / "weights").read_text() == "v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_replacing_dir_recovers_from_a_crash_mid_swap(tmp_path: Path) -> None:
    # a crash left a stale temp folder and the previous checkpoint moved aside as .old, with no ckpt in place
    (tmp_path / "ckpt.tmp").mkdir()
    (tmp_path / "ckpt.tmp" / "weights").write_text("half")
    (tmp_path / "ckpt.old").mkdir()
    (tmp_path / "ckpt.old" / "weights").write_text("v1")
    with replacing_dir(tmp_path / "ckpt") as tmp:
        assert list(tmp.iterdir()) == []  # the stale temp folder was cleared
        (tmp / "weights").write_text("v2")
    assert (tmp_path / "ckpt" / "weights").read_text() == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_swap_cut_between_its_renames_is_finished_for_the_reader(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    (tmp_path / "latest.old").mkdir()
    (tmp_path / "latest.old" / "state.json").write_text("{}")
    assert finish_interrupted_swap(tmp_path / "latest") == tmp_path / "latest"
    assert (tmp_path / "latest" / "state.json").read_text() == "{}" and not (tmp_path / "latest.old").exists()
    assert "restored the previous one from latest.old" in caplog.text
    finish_interrupted_swap(tmp_path / "latest")  # nothing to do when the folder is there
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
