"""``rtx pull``: a Hugging Face Hub model into the local Hugging Face cache, with progress bars, for serving later
(or elsewhere: copy the cache folder) without the network."""

from __future__ import annotations

import argparse

from rtxcore.cli.common import non_empty


def add_parser(sub) -> None:
    p = sub.add_parser("pull", help="download a Hugging Face Hub model (owner/name) into the local HF cache",
                       description="Download a model's config, tokenizer and safetensors weights from the Hugging "
                                   "Face Hub into the local cache (HF_HOME, HF_HUB_CACHE), as `rtx serve owner/name` "
                                   "would; prints the snapshot folder. Gated models need HF_TOKEN.")
    p.add_argument("model", type=non_empty, help="the Hub id, owner/name")
    p.add_argument("--revision", type=non_empty, default=None, help="branch, tag or commit (default: main)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rtxcore.errors import ConfigError
    from rtxcore.models.hub import hub_snapshot, is_hub_id

    if not is_hub_id(args.model):
        raise ConfigError(f"{args.model!r} is not a Hugging Face Hub id (owner/name)")
    print(hub_snapshot(args.model, args.revision))
    return 0
