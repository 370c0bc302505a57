"""``rtx run-batch``: an OpenAI batch file (JSONL of chat completions, completions or embeddings) run offline, answers
written to a JSONL file as they end (rtxcore.server.batch_file)."""

from __future__ import annotations

import argparse
import sys
import time

from rtxcore.cli.common import add_engine_options, engine_config, finite_float, output_file, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run-batch", help="run an OpenAI batch file (JSONL) offline",
                       usage="%(prog)s -i INPUT.jsonl -o OUTPUT.jsonl [options] [MODEL]",
                       description="Run every request of an OpenAI batch file (one JSON object per line: custom_id, "
                                   "method POST, url /v1/chat/completions, /v1/completions or /v1/embeddings, and "
                                   "body) through the same API as rtx serve, without a server, and write one answer "
                                   "per line, with its custom_id, as each ends.")
    p.add_argument("-i", "--input-file", required=True, metavar="INPUT.jsonl", help="the batch file to run")
    p.add_argument("-o", "--output-file", required=True, type=output_file, metavar="OUTPUT.jsonl",
                   help="where the answers go (overwritten)")
    p.add_argument("--max-concurrency", type=positive_int, default=None, metavar="N",
                   help="requests sent at once (default: --max-num-seqs, what the engine runs at once)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names the bodies' model field may give, besides the model's own")
    p.add_argument("--request-timeout", type=finite_float, default=3600.0,
                   help="seconds before a request is given up (its answer: 504)")
    add_engine_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from rtxcore.cli.progress import Progress
    from rtxcore.errors import RtxError
    from rtxcore.server.batch_file import read_batch_file, run_batch
    from rtxcore.server.serving.runtime import ServeSettings, ServingRuntime

    lines = read_batch_file(Path(args.input_file).expanduser())  # checked whole before the model loads
    settings = ServeSettings(
        grpc_port=None, request_timeout_s=args.request_timeout,
        # The batch's own concurrency bounds what runs; the server's admission limit must not refuse it.
        max_active_requests=1 << 30,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        served_model_aliases=tuple(args.served_model_name[1:]) if args.served_model_name else ())
    config = engine_config(args)
    runtime = ServingRuntime(config, settings, progress=Progress("weights"))
    runtime.load()
    if runtime.load_error is not None:
        error = runtime.load_error
        raise error if isinstance(error, RtxError) else RtxError(f"the model failed to load: {error}")
    start = time.monotonic()
    try:
        with open(args.output_file, "w", encoding="utf-8") as out:
            summary = asyncio.run(run_batch(runtime, lines, out, args.max_concurrency or config.scheduling.max_num_seqs,
                                            Progress("requests", unit="req")))
    finally:
        runtime.stop()
    failed = f"{summary.num_failed} refused or failed (see their status_code)" if summary.num_failed else "none failed"
    sys.stderr.write(f"{summary.num_requests} requests in {time.monotonic() - start:.1f}s, {failed}; answers in "
                     f"{args.output_file}\n")
    # As OpenAI's batches: a batch that ran is done, whatever its requests' statuses; they are in the answers.
    return 0
