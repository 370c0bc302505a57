"""``rtx sbom``: a CycloneDX SBOM (JSON) of the installed environment."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("sbom", help="write a CycloneDX SBOM of the installed environment",
                       description="Write a CycloneDX (1.6, JSON) software bill of materials of every package "
                                   "installed for this Python, rtx-serve and its serving dependencies included.")
    p.add_argument("--out", default=None, metavar="FILE", help="write to FILE (default: stdout)")
    p.add_argument("--validate", action="store_true",
                   help="check the document against the CycloneDX schema first (slow: about 25 s)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rtxcore.provenance.sbom import write_sbom

    document = write_sbom(args.out, validate=args.validate)
    if args.out not in (None, "-"):
        sys.stderr.write(f"rtx sbom: {len(document.get('components', []))} components written to {args.out}\n")
    return 0
