"""``rtx chat``: a multi-turn chat in the terminal, streamed, against a local engine or a running server (``--url``).

Type a message and Enter; ``/reset`` starts the conversation over (keeping the system prompt), ``/exit`` (or
Ctrl-D) leaves, Ctrl-C stops the answer being written.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator

from rtxcore import envs
from rtxcore.cli.common import (
    TEMPERATURE_HELP,
    add_engine_options,
    engine_config,
    finite_float,
    http_url,
    load_engine,
)
from rtxcore.sampling_params import SamplingParams

Messages = list[dict[str, str]]
_EXIT = ("/exit", "/quit", "/bye")


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal (multi-turn, streamed; /reset, /exit)",
                       usage="%(prog)s [options] [MODEL]",
                       description="An interactive chat: each message goes with the conversation so far, the answer "
                                   "streams back. /reset starts over, /exit or Ctrl-D leaves, Ctrl-C stops an "
                                   "answer. Runs MODEL (or the default model) here, or talks to a server with --url, "
                                   "asking it for MODEL where one is given.")
    p.add_argument("--url", type=http_url, default=None,
                   help="a running rtx serve (or any OpenAI-compatible server), e.g. http://127.0.0.1:8000, instead "
                        "of loading the model here")
    p.add_argument("--api-key", default=None,
                   help="with --url: the server's key (default: $RTX_API_KEY, then $OPENAI_API_KEY)")
    p.add_argument("--system", default=None, help="system prompt, kept across /reset")
    p.add_argument("--max-tokens", type=int, default=512, help="longest answer (default: 512)")
    p.add_argument("--temperature", type=finite_float, default=SamplingParams().temperature, help=TEMPERATURE_HELP)
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling, for repeatable answers")
    add_engine_options(p)
    p.set_defaults(run=run)


class LocalChat:
    """The model loaded in this process."""

    def __init__(self, args: argparse.Namespace):
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        self.engine = load_engine(engine_config(args))
        self.name = self.engine.core.source.name

    def stream(self, messages: Messages) -> Iterator[str]:
        prompt = self.engine.inputs.apply_chat_template(messages)
        for out in self.engine.stream(prompt, self.params):
            yield out.new_text


class RemoteChat:
    """A server's /v1/chat/completions, through the project's client."""

    def __init__(self, args: argparse.Namespace):
        from rtxcore.client import Client

        key = args.api_key or envs.RTX_API_KEY.get() or os.environ.get("OPENAI_API_KEY")
        self.client = Client(args.url, api_key=key)
        self.name = args.model or self.client.models()["data"][0]["id"]
        self.params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}

    def stream(self, messages: Messages) -> Iterator[str]:
        events = self.client.stream_chat(messages, model=self.name, **self.params)
        try:
            for event in events:
                for choice in event.get("choices", []):
                    yield choice.get("delta", {}).get("content") or ""
        finally:
            events.close()


def run(args: argparse.Namespace) -> int:
    chat = RemoteChat(args) if args.url is not None else LocalChat(args)
    start: Messages = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    print(f"chatting with {chat.name}: /reset starts over, /exit leaves", flush=True)
    while True:
        try:
            line = input(">>> ")
        except EOFError:  # Ctrl-D
            print()
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, as a shell does
            print()
            continue
        text = line.strip()
        if text in _EXIT:
            return 0
        if text == "/reset":
            messages = list(start)
            print("(conversation cleared)", flush=True)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": line})
        answer = []
        try:
            for piece in chat.stream(messages):
                answer.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:  # the answer so far stays in the conversation
            sys.stdout.write(" [stopped]")
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(answer)})
