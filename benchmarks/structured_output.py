"""The cost of structured output: tokens/s of a batch of JSON-schema requests against the same batch unconstrained.

    python benchmarks/structured_output.py [--model PATH] [--shape SHAPE] [--device cpu|cuda] [--batch 32]
        [--tokens 64] [--runs 3] [--grammar-proposals auto|on|off] [--compare-plain] [--mask-threads N] [--json PATH]

Both batches decode exactly ``--tokens`` tokens per request: the schema asks for more items than fit (so the grammar
never ends a request early) and the free batch ignores EOS. Runs alternate (free, guided, free, ...) in one engine
after a warm-up of each; the figure is the median of ``--runs``. The model needs a tokenizer (the default model, or
its GGUF file given by path). ``--shape llama-8b`` runs random weights of that shape (``dummy:llama-8b``) with the
model's tokenizer and vocabulary instead: a model whose forward pass, not the host, sets the step time, which the
default model on a GPU is not.

The guided batch runs as the engine runs it by default, where the tokens a grammar forces are proposed and verified
in one step (``--grammar-proposals`` sets it); ``--compare-plain`` also runs it on a second engine of the same model
that proposes nothing (every token its own step), alternating with the others. The grammar's proposals are reported
with their acceptance (tokens proposed and accepted, verifications). ``--mask-threads`` sets the threads that fill
the masks (the processor's option ``mask_threads``; default: its own choice, reported).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm import LLM
from rtxcore.engine.speculation.config import SpeculativeConfig
from rtxcore.engine.speculation.speculator import GRAMMAR, ProposerStats
from rtxcore.models.dummy import SHAPES, DummySource
from rtxcore.models.resolve import resolve_model
from rtxcore.models.source import ModelSource
from rtxcore.sampling_params import SamplingParams

# Items no request can finish within its budget: every guided request runs to max_tokens, like the free ones.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "steps": {"type": "array", "minItems": 60,
                  "items": {"type": "object", "properties": {"n": {"type": "integer"}, "text": {"type": "string"}},
                            "required": ["n", "text"]}},
    },
    "required": ["title", "steps"],
}
TOPICS = ["baking bread", "changing a tyre", "planting a tree", "writing a letter", "making tea", "tying a knot",
          "cleaning a bike", "painting a wall"]


class ShapeWithTokenizer(DummySource):
    """Random weights of a dummy shape, with another model's tokenizer (and so its vocabulary and special tokens):
    dummy shapes have no tokenizer, and a grammar needs one."""

    def __init__(self, shape: str, tokenizer_source: ModelSource):
        super().__init__(shape)
        vocab = tokenizer_source.config
        self._config = dataclasses.replace(self._config, vocab_size=vocab.vocab_size, bos_token_id=vocab.bos_token_id,
                                           eos_token_ids=vocab.eos_token_ids)
        self.name = f"dummy:{shape}+{tokenizer_source.name}-tokenizer"
        self._tokenizer_source = tokenizer_source

    def tokenizer(self):
        return self._tokenizer_source.tokenizer()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="random weights of this shape with --model's tokenizer and vocabulary")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--grammar-proposals", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--compare-plain", action="store_true",
                        help="also run the guided batch on an engine whose grammars propose nothing")
    parser.add_argument("--mask-threads", type=int, default=None,
                        help="structured_output's mask_threads option (default: the processor's own)")
    parser.add_argument("--json", default=None, help="also write the report to this file")
    args = parser.parse_args()
    processor_options = {"structured_output": {"mask_threads": args.mask_threads}} if args.mask_threads else {}
    proposals = {"auto": None, "on": True, "off": False}[args.grammar_proposals]
    source = ShapeWithTokenizer(args.shape, resolve_model(args.model)) if args.shape else None
    llm = LLM(EngineConfig(model=args.model, device=args.device, logits_processor_options=processor_options,
                           speculative=SpeculativeConfig(grammar_proposals=proposals)), source=source)
    plain = LLM(EngineConfig(model=args.model, device=args.device, logits_processor_options=processor_options,
                             speculative=SpeculativeConfig(grammar_proposals=False)),
                source=source) if args.compare_plain else None
    prompts = [llm.inputs.apply_chat_template([{"role": "user", "content": f"List the steps of {TOPICS[i % 8]} "
                                                 f"as JSON (request {i})."}]) for i in range(args.batch)]
    free = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    guided = SamplingParams(max_tokens=args.tokens, temperature=0.0, structured_output={"json": SCHEMA})

    def tokens_per_s(params: SamplingParams, engine: LLM = llm) -> float:
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
        count = sum(len(r.token_ids) for r in results)
        if count != args.batch * args.tokens:
            raise SystemExit(f"expected {args.batch * args.tokens} tokens, got {count}: a request ended early")
        return count / elapsed

    tokens_per_s(free), tokens_per_s(guided)  # warm-up: kernels, graphs, the grammar's compile and lexer
    if plain is not None:
        tokens_per_s(guided, plain)
    rates: dict[str, list[float]] = {"free": [], "guided": [], **({"guided_plain": []} if plain else {})}
    stats = llm.core.speculator.stats.get(GRAMMAR, ProposerStats())
    before = (stats.num_proposed_tokens, stats.num_accepted_tokens, stats.num_verifications)
    for _ in range(args.runs):
        rates["free"].append(tokens_per_s(free))
        rates["guided"].append(tokens_per_s(guided))
        if plain is not None:
            rates["guided_plain"].append(tokens_per_s(guided, plain))
    proposed, accepted, verifications = (now - then for now, then in zip(
        (stats.num_proposed_tokens, stats.num_accepted_tokens, stats.num_verifications), before))
    sample = llm.generate(prompts[:1], SamplingParams(max_tokens=24, temperature=0.0,
                                                      structured_output={"json": SCHEMA}))[0].text
    free_s, guided_s = statistics.median(rates["free"]), statistics.median(rates["guided"])
    report = {"model": llm.core.source.name, "device": str(llm.core.backend.device), "batch": args.batch,
              "tokens": args.tokens, "mask_threads": llm.core.logits.processors["structured_output"].mask_threads,
              "free_tok_s": round(free_s, 1), "guided_tok_s": round(guided_s, 1),
              "ratio": round(guided_s / free_s, 3),
              "grammar_proposals": {"proposed": proposed, "accepted": accepted, "verifications": verifications,
                                    "of_guided_tokens": round(accepted / (args.runs * args.batch * args.tokens), 3)}}
    if plain is not None:
        plain_s = statistics.median(rates["guided_plain"])
        report |= {"guided_plain_tok_s": round(plain_s, 1), "plain_ratio": round(plain_s / free_s, 3)}
    text = json.dumps({**report, "runs": rates, "guided_sample": sample})
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
