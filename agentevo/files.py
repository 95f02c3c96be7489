"""Atomic writes: a file or a folder appears whole or not at all, so an interrupted run never reads half of one.

Everything a run writes and later reads back (state.json, checkpoints, labels, caches, reports, exports) goes through
these: the content is written beside its destination as NAME.tmp and renamed into place only once complete. A folder
that already exists is first renamed to NAME.old and removed after the swap, so at every instant either the previous
folder or the new one is whole on disk (resume code looks for NAME.old when NAME is missing).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """Yield NAME.tmp beside path (parents created); when the block ends normally it replaces path in one rename, when
    it raises, the temp file is removed and path is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise
    os.replace(tmp, path)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write text to path through a temp file and a rename; returns path."""
    with replacing(path) as tmp:
        tmp.write_text(text)
    return Path(path)


@contextmanager
def replacing_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty folder NAME.tmp beside path (a stale one from a crash is cleared); when the block ends normally
    it takes path's place (an existing path is kept as NAME.old until then), when it raises it is removed."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = path.with_name(path.name + ".old")
    if path.exists():
        if old.exists():
            _remove(old)
        os.replace(path, old)
    os.replace(tmp, path)
    if old.exists():
        _remove(old)


def finish_interrupted_swap(path: str | Path) -> Path:
    """A replacing_dir swap cut short between its two renames leaves NAME.old and no NAME: put the previous folder
    back (with a warning) so a reader finds it; returns path."""
    path = Path(path)
    old = path.with_name(path.name + ".old")
    if not path.exists() and old.is_dir():
        os.replace(old, path)
        log.warning("%s was missing after a save cut short; restored the previous one from %s", path, old.name)
    return path
