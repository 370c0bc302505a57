"""``rtx generate``: stream one completion to the terminal."""

from __future__ import annotations

import argparse
import sys

from rtxcore.cli.common import TEMPERATURE_HELP, add_engine_options, engine_config, finite_float, load_engine
from rtxcore.cli.speculation import describe_stats
from rtxcore.sampling_params import SamplingParams


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal",
                       usage="%(prog)s [options] [MODEL] PROMPT",
                       description="Stream one completion to the terminal. One positional argument is the prompt, "
                                   "two are the model and the prompt: `rtx generate PROMPT` runs the default model "
                                   "(or --model's), `rtx generate MODEL PROMPT` runs MODEL.")
    add_engine_options(p)  # the optional MODEL first: then PROMPT
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens generated")
    p.add_argument("--temperature", type=finite_float, default=SamplingParams().temperature,
                   help=TEMPERATURE_HELP)
    p.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling: keep the most likely tokens "
                   "up to this total probability")
    p.add_argument("--top-k", type=int, default=0, help="keep only the K most likely tokens; 0: all")
    p.add_argument("--min-p", type=finite_float, default=0.0,
                   help="drop tokens less likely than this fraction of the most likely one")
    p.add_argument("--repetition-penalty", type=finite_float, default=1.0,
                   help="above 1 makes tokens already in the text less likely")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling, for repeatable output")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    p.add_argument("--min-tokens", type=int, default=0,
                   help="tokens generated before the end-of-sequence token or a stop string may end the output")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Validate the request before spending seconds on loading the model.
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
        ignore_eos=args.ignore_eos, min_tokens=args.min_tokens)
    if not args.prompt:
        from rtxcore.errors import InvalidRequestError

        raise InvalidRequestError("prompt is empty")
    if args.system is not None and not args.chat:
        from rtxcore.errors import ConfigError

        raise ConfigError("--system is the chat template's system message: it needs --chat")
    config = engine_config(args)
    engine = load_engine(config)
    prompt = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = engine.inputs.apply_chat_template(messages + [{"role": "user", "content": prompt}])
    failure = None
    for out in engine.stream(prompt, params):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
        if out.finished:
            sys.stdout.write("\n")
            sys.stderr.write(f"[{out.num_output_tokens} tokens, finish reason: {out.finish_reason}]\n")
            failure = out.error
    method = config.speculative.method
    if method is not None:
        sys.stderr.write(f"[{describe_stats(method, engine.core.speculator.stats[method])}]\n")
    if failure is not None:  # a plugin failed on the request: the output above is cut short
        sys.stderr.write(f"rtx: error: {failure.describe()}\n")
        return 1
    return 0
