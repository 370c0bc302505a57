"""``rtx generate``: stream one completion to the terminal."""

from __future__ import annotations

import argparse
import sys

from rtxcore.cli.common import add_engine_options, engine_config, finite_float, load_engine
from rtxcore.cli.speculation import describe_stats
from rtxcore.sampling_params import SamplingParams


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=finite_float, default=0.0, help="0 for greedy (default)")
    p.add_argument("--top-p", type=finite_float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=finite_float, default=0.0)
    p.add_argument("--repetition-penalty", type=finite_float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    add_engine_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Validate the request before spending seconds on loading the model.
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
        ignore_eos=args.ignore_eos)
    if not args.prompt:
        from rtxcore.errors import InvalidRequestError

        raise InvalidRequestError("prompt is empty")
    config = engine_config(args)
    engine = load_engine(config)
    prompt = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = engine.inputs.apply_chat_template(messages + [{"role": "user", "content": prompt}])
    for out in engine.stream(prompt, params):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
        if out.finished:
            sys.stdout.write("\n")
            sys.stderr.write(f"[{out.num_output_tokens} tokens, finish reason: {out.finish_reason}]\n")
    method = config.speculative.method
    if method is not None:
        sys.stderr.write(f"[{describe_stats(method, engine.core.speculator.stats[method])}]\n")
    return 0
