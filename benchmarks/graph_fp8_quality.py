"""Perplexity of the onnxruntime backend on the quality gate's evaluation text, float32 against the fp8 Q/DQ export
(the graph the tensorrt backend builds in fp8), each exported into a fresh cache.

Usage: python benchmarks/graph_fp8_quality.py [--tokens 512]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm_engine import LLMEngine
from rtxcore.models.source import resolve_model
from rtxcore.quant.evaluation import backend_perplexity
from rtxcore.quant.pipeline import evaluation_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    os.environ["RTX_GRAPH_CACHE"] = tempfile.mkdtemp()
    source = resolve_model(None)
    ids = evaluation_tokens(source, args.tokens)
    for quantization in (None, "fp8"):
        engine = LLMEngine(EngineConfig(backend="onnxruntime", quantization=quantization, num_kv_blocks=64),
                           source=source)
        ppl = backend_perplexity(engine.backend, ids, args.tokens)
        print(f"{quantization or 'float32':8} perplexity {ppl:.3f}  export {engine.backend.graph.export_s:.1f} s")
        del engine


if __name__ == "__main__":
    main()
