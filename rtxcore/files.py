"""Crash-safe file writes shared by what the server keeps on disk (the request journal, KV-cache snapshots), and the
check of the directories it keeps them in."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from rtxcore.errors import ConfigError


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in ``directory`` durable (the directory entry is data too)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until every byte is out: a short write would leave a partial record for the next to follow."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def replace_atomically(path: Path, data: bytes | Sequence[bytes | memoryview], durable: bool = True) -> None:
    """Write ``data`` (or its parts one after another: no copy joins them) to a temporary file beside ``path`` and
    rename it over ``path``: a crash leaves the old file or the new one, never half of one. With ``durable``, both
    the file and the rename are fsynced."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for part in (data,) if isinstance(data, bytes) else data:
            write_all(fd, part)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def check_directory_path(path: str, what: str, make_parents: bool = True) -> None:
    """A directory that is there or can be made: the nearest existing part of ``path`` must be a directory.

    :param make_parents: False: only ``path`` itself may be missing (it will be made, but not its parents).
    :raises ConfigError: naming ``what`` (the flag or setting) and the file in the way, or the missing parent.
    """
    for part in (Path(path), *Path(path).parents):
        if part.exists():
            if not part.is_dir():
                in_the_way = "" if part == Path(path) else f" ({part} is a file)"
                raise ConfigError(f"{what} {path!r} is not a directory{in_the_way}")
            if not make_parents and part not in (Path(path), Path(path).parent):
                raise ConfigError(f"{what} {path!r}: {Path(path).parent} does not exist (only the last directory is "
                                  "made: create the others first, or check the path for a typo)")
            return
