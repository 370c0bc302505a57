"""Models by Hugging Face Hub id (``Qwen/Qwen2.5-0.5B-Instruct``), through ``huggingface_hub`` and its cache.

A Hub id resolves to a snapshot folder of the local Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``), which
the Hugging Face directory loader then reads. What is cached is used without asking the Hub; what is not is
downloaded first (with huggingface_hub's progress bars), unless ``HF_HUB_OFFLINE=1``. Gated models take the
token huggingface_hub finds (``HF_TOKEN``, or ``huggingface-cli login``'s).
"""

from __future__ import annotations

import re
from pathlib import Path

from rtxcore.errors import ModelLoadError

# owner/name as the Hub allows them; a local path that exists is never taken for an id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# What the loaders read: configs and tokenizers, safetensors weights. Not the .bin, .pth or ONNX copies many repos
# also carry.
_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def is_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.match(spec)) and not Path(spec).expanduser().exists()


def hub_snapshot(repo_id: str, revision: str | None = None, download: bool = True) -> Path:
    """The local snapshot folder of ``repo_id`` at ``revision`` (default: main), downloading what is missing when
    ``download`` and the Hub is not switched off (``HF_HUB_OFFLINE``).

    :raises ModelLoadError: not cached and not downloadable, naming why and what to do.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}{'@' + revision if revision else ''}"
    try:
        # The cache first, without a request: a model that is there starts without the network.
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if not download or constants.HF_HUB_OFFLINE:
        raise ModelLoadError(f"{where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the Hub is "
                             "off (HF_HUB_OFFLINE): run `rtx pull " + repo_id + "` where the Hub can be reached, "
                             "or copy its cache folder here") from None
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_PATTERNS))
    except GatedRepoError:
        raise ModelLoadError(f"{where} is gated: accept its license on huggingface.co, then set HF_TOKEN to a token "
                             "of that account") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"{repo_id} is not a model on the Hugging Face Hub (or is private: set HF_TOKEN)") \
            from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"{repo_id} has no revision {revision!r}") from None
    except (LocalEntryNotFoundError, OSError) as exc:  # no network, DNS, proxy, TLS: all end here
        raise ModelLoadError(f"cannot download {where} from the Hugging Face Hub ({type(exc).__name__}): check the "
                             "network (or HF_ENDPOINT), or run `rtx pull " + repo_id + "` where the Hub can be "
                             f"reached and copy the cache ({constants.HF_HUB_CACHE})") from None
