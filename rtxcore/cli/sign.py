"""``rtx sign`` and ``rtx verify``: sign a model (file or directory) with an EC private key, verify it with the public
key (OpenSSF model signing, offline). ``rtx serve --require-signed-models`` applies the same check at load time."""

from __future__ import annotations

import argparse
import sys

from rtxcore.cli.common import output_file


def add_parser(sub) -> None:
    p = sub.add_parser("sign", help="sign a model file or directory with an EC private key",
                       description="Sign a model (a .gguf file, a Hugging Face directory or an ONNX export "
                                   "directory) with a PEM elliptic-curve private key. The signature goes to "
                                   "FILE.sig, or DIR/model.sig for a directory.")
    p.add_argument("model", help="model file or directory")
    p.add_argument("--key", required=True, metavar="PEM", help="EC private key (PEM)")
    p.add_argument("--signature", type=output_file, default=None, metavar="FILE",
                   help="where to write the signature")
    p.set_defaults(run=run_sign)

    p = sub.add_parser("verify", help="verify a model's signature with an EC public key",
                       description="Verify a model against its signature and a PEM elliptic-curve public key. "
                                   "Exit code 0: verified; 2: missing, foreign or mismatched signature.")
    p.add_argument("model", help="model file or directory")
    p.add_argument("--key", required=True, metavar="PUB", help="EC public key (PEM)")
    p.add_argument("--signature", default=None, metavar="FILE", help="signature (default: FILE.sig or DIR/model.sig)")
    p.set_defaults(run=run_verify)


def run_sign(args: argparse.Namespace) -> int:
    from rtxcore.provenance.signing import sign_model

    signature = sign_model(args.model, args.key, args.signature)
    sys.stdout.write(f"signed {args.model}: {signature}\n")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from rtxcore.provenance.signing import verify_model

    signature = verify_model(args.model, args.key, args.signature)
    sys.stdout.write(f"verified {args.model} against {signature}\n")
    return 0
