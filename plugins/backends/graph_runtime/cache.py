"""Where exported graphs (and engines built from them) live on disk, and the key that names them.

The key covers everything that changes the file: the weights (their bytes), the model's shape, the export settings
and the exporter's version. A changed key means a new file; an unchanged one means the file is reused as is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from rtxcore import envs
from rtxcore.errors import RtxError
from rtxcore.models.config import ModelConfig

log = logging.getLogger("rtx.graph_cache")

# The variable naming the cache directory, for code that sets it for a child process or a test.
CACHE_DIR_ENV = envs.RTX_GRAPH_CACHE.name


def default_cache_dir() -> Path:
    """``$RTX_GRAPH_CACHE``, else ``$XDG_CACHE_HOME/rtx-serve/graphs`` (``~/.cache/rtx-serve/graphs``)."""
    configured = envs.RTX_GRAPH_CACHE.get()
    if configured is not None:
        return configured
    # XDG_CACHE_HOME is the XDG base-directory variable, not one of ours: read as the specification says.
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rtx-serve" / "graphs"


@dataclass(frozen=True, slots=True)
class CacheKey:
    # What the cached file is ("onnx", "tensorrt"): one key never names two kinds of file.
    kind: str
    weights: str
    model: dict
    settings: dict

    @property
    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:24]


def model_fingerprint(config: ModelConfig) -> dict:
    return json.loads(json.dumps(asdict(config), default=str))


class GraphCache:
    """A directory of ``<kind>-<digest>/`` entries, each written to a temporary directory and renamed into place,
    so a reader never sees half a file and two processes building the same entry do not corrupt each other.

    With ``verify`` (a server checking signed models), an entry is reused only if ``verify(entry_dir)`` passes (it
    raises otherwise): the key names what the file should hold, not what is on disk now, so a file changed after
    it was written would otherwise run unchecked. An entry that fails is rebuilt from the (verified) weights.
    """

    def __init__(self, root: Path | None = None, verify: Callable[[Path], object] | None = None):
        self.root = root or default_cache_dir()
        self.verify = verify

    def entry(self, key: CacheKey) -> Path:
        return self.root / f"{key.kind}-{key.digest}"

    def lookup(self, key: CacheKey, filename: str) -> Path | None:
        path = self.entry(key) / filename
        if not path.is_file():
            return None
        if self.verify is not None:
            try:
                self.verify(path.parent)
            except RtxError as exc:
                log.warning("not reusing %s: %s; rebuilding it from the verified weights", path.parent, exc)
                return None
        return path

    def discard(self, key: CacheKey) -> None:
        shutil.rmtree(self.entry(key), ignore_errors=True)

    def store(self, key: CacheKey, filename: str, build: Callable[[Path], None]) -> Path:
        """Run ``build(path)`` to write ``filename`` into a fresh entry, record the key beside it, publish it."""
        final = self.entry(key)
        self.root.mkdir(parents=True, exist_ok=True)
        if self.verify is not None and final.exists():
            shutil.rmtree(final)  # it failed verification in lookup: never fall back to it below
        with tempfile.TemporaryDirectory(dir=self.root, prefix=".building-") as tmp:
            build(Path(tmp) / filename)
            (Path(tmp) / "key.json").write_text(json.dumps(asdict(key), indent=2, sort_keys=True, default=str))
            os.chmod(tmp, 0o755)  # temporary directories are private; a cache entry is as readable as its root
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / filename).is_file():  # not a concurrent builder of the same entry: a real failure
                    raise
            else:
                os.mkdir(tmp)  # TemporaryDirectory removes its path on exit; give it an empty one
        return final / filename
