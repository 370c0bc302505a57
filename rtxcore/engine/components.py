"""The parts an engine core is made of, built from its config: the plugins it names (resolved once, here), the
backend with the model loaded, the KV cache sized from memory, and the lower KV tiers."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, cast

import torch

from rtxcore.contracts.backend import BackendOptions, ExecutionBackend, runs_quantization
from rtxcore.contracts.logits_processor import LogitsProcessorContext
from rtxcore.contracts.proposer import Proposer, ProposerContext
from rtxcore.contracts.sampler import Sampler
from rtxcore.contracts.scheduler import Scheduler
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.logits_processing import LogitsProcessing, build_processors
from rtxcore.engine.output_processor import OutputProcessor
from rtxcore.engine.speculation.speculator import ASSISTED, Speculator
from rtxcore.errors import ConfigError, PluginError
from rtxcore.kv.manager import KVCacheManager
from rtxcore.kv.tiers.stack import KVTiers
from rtxcore.models.resolve import resolve_model
from rtxcore.models.source import ModelSource
from rtxcore.registry import PluginRegistry, load_plugins
from rtxcore.tokenizer import Tokenizer

log = logging.getLogger("rtx.plugins")


@dataclass(slots=True)
class EngineComponents:
    registry: PluginRegistry
    source: ModelSource
    # Loaded, with its KV cache allocated.
    backend: ExecutionBackend
    tokenizer: Tokenizer | None
    # Longest sequence accepted: the config's limit within the model's context.
    max_model_len: int
    # Host and disk tiers under the device's prefix cache; None when none is configured.
    kv_tiers: KVTiers | None
    kv_cache: KVCacheManager
    scheduler: Scheduler
    sampler: Sampler
    output_processor: OutputProcessor
    speculator: Speculator
    logits: LogitsProcessing


def build_components(config: EngineConfig, registry: PluginRegistry | None, source: ModelSource | None,
                     progress: Callable[[int, int], None] | None) -> EngineComponents:
    # Plugins are resolved once here; nothing on the per-token path goes through the plugin manager.
    if registry is None:
        registry = load_plugins()
        for failure in registry.failures:  # skipped, the engine runs without it (as vLLM warns of a plugin)
            log.warning("plugin %s (%s) was not loaded: %s; `rtx plugins list` shows every plugin", failure.plugin,
                        failure.package, failure.error)
    source = source or resolve_model(config.model, config.revision)
    backend = make_backend(config, registry, source)
    # The tokenizer is built (0.2 s for a 49k vocabulary) while the weights load: most of loading runs in torch
    # kernels that let another thread work, and start-up time is what `rtx generate` is judged by.
    with ThreadPoolExecutor(1, thread_name_prefix="rtx-tokenizer") as pool:
        pending_tokenizer = pool.submit(source.tokenizer)
        backend.load(source, progress=progress)
        tokenizer = pending_tokenizer.result()
    model_config = backend.model_config
    if config.chat_template is not None:
        if tokenizer is None:
            raise ConfigError(f"--chat-template: {source.name} has no tokenizer to apply a chat template with")
        tokenizer.use_chat_template(config.chat_template)
    if config.max_model_len and config.max_model_len > model_config.max_position:
        # Not cut down to what the model has without a word (vLLM refuses too): positions past those it was trained
        # on give text that only looks like an answer.
        raise ConfigError(f"--max-model-len {config.max_model_len} is more than the {model_config.max_position} "
                          f"positions of {source.name} (its max_position_embeddings)")
    max_model_len = config.max_model_len or model_config.max_position
    num_blocks = config.num_kv_blocks or _num_blocks_from_memory(config, backend, max_model_len)
    policy = registry.create("eviction_policy", config.eviction_policy, num_blocks)
    with _sized_by("--num-kv-blocks", f"a KV cache of {num_blocks} blocks"):
        backend.allocate_kv_cache(num_blocks, config.block_size)
    with _sized_by("--kv-host-bytes and --kv-disk-dir", "the KV tiers"):
        kv_tiers = (KVTiers(config, backend, registry, source) if config.kv_host_bytes or config.kv_disk_dir
                    else None)
    kv_cache = KVCacheManager(num_blocks, config.block_size, policy, config.enable_prefix_caching,
                              kv_tiers.offload if kv_tiers is not None else None)
    if kv_tiers is not None:
        kv_tiers.load_snapshot()
    spec = config.speculative
    scheduling = replace(config.scheduling, speculative=spec.method is not None)
    scheduler = registry.create("scheduler", config.scheduler, scheduling, kv_cache)
    sampler = registry.create("sampler", config.sampler)
    eos = tokenizer.eos_token_ids if tokenizer is not None else model_config.eos_token_ids
    output_processor = OutputProcessor(tokenizer, list(eos), max_model_len)
    if spec.method is not None:
        _check_proposer_options(registry, spec.method, spec.options)
    context = ProposerContext(backend, config.block_size, num_blocks, max_model_len, registry, kv_cache.block_table,
                              load_model=lambda name: _load_draft(config, registry, name), options=dict(spec.options))
    proposers: dict[str, Proposer] = {ASSISTED: registry.create("proposer", ASSISTED, context)}
    if spec.method is not None:
        proposers[spec.method] = registry.create("proposer", spec.method, context)
    # Every installed processor is ready: a request asks for one by name. Each builds its tables on first use.
    logits_context = LogitsProcessorContext(tokenizer, model_config.vocab_size, list(eos), backend.device)
    logits = LogitsProcessing(build_processors(registry, logits_context, config.logits_processor_options))
    grammar_proposals = spec.grammar_proposals
    if grammar_proposals is None:  # where steps run one after another anyway
        grammar_proposals = not steps_overlap(config, backend)
    speculator = Speculator(spec, proposers, kv_cache, model_config.vocab_size, max_model_len,
                            allowed=scheduler.allows_speculation,
                            forced_tokens=logits.forced_tokens if grammar_proposals else None)
    return EngineComponents(registry, source, backend, tokenizer, max_model_len, kv_tiers, kv_cache, scheduler,
                            sampler, output_processor, speculator, logits)


def _check_proposer_options(registry: PluginRegistry, name: str, options: dict[str, Any]) -> None:
    """:raises ConfigError: an option the proposer does not list under its describe()'s ``"options"``: refused, as a
        logits processor's is, rather than silently ignored by a proposer that does not check its own."""
    cls: type[Proposer] = registry.get("proposer", name).cls
    accepted = list(cls.describe().get("options", []))
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(f"unknown {name} option {unknown[0]!r} (options: {', '.join(accepted) or 'none'})")


@contextlib.contextmanager
def _sized_by(flags: str, what: str) -> Iterator[None]:
    """Memory that a setting sizes and the machine cannot give (or a place that cannot be made) is that setting's
    error, named, not a traceback from the allocator."""
    try:
        yield
    except (MemoryError, OverflowError, torch.OutOfMemoryError) as exc:
        raise ConfigError(f"cannot allocate {what}: {type(exc).__name__} {exc}".rstrip() + f"; check {flags}") \
            from None
    except RuntimeError as exc:
        if "allocate" not in str(exc):  # torch's CPU allocator: "DefaultCPUAllocator: can't allocate memory"
            raise
        raise ConfigError(f"cannot allocate {what}: {str(exc).splitlines()[0]}; check {flags}") from None
    except OSError as exc:  # an anonymous map too large (ENOMEM), a tier directory that cannot be made
        raise ConfigError(f"cannot set up {what}: {exc.strerror or exc}"
                          f"{f' ({exc.filename})' if exc.filename else ''}; check {flags}") from None


def steps_overlap(config: EngineConfig, backend: ExecutionBackend) -> bool:
    """Whether the engine launches each step before reading the last one's tokens: by default where the model runs
    on an accelerator, but not with a proposer, which needs the accepted tokens on the host (requests that bring
    their own tokens make the overlapped step run a serial one while they last)."""
    if config.async_scheduling is not None:
        return config.async_scheduling
    return backend.device.type != "cpu" and config.speculative.method is None


def _load_draft(config: EngineConfig, registry: PluginRegistry, name: str) -> ExecutionBackend:
    """A draft model, by the names --model takes, run by the target's backend on its device in its dtype."""
    # The draft is small and runs on rank 0 alone, unsplit, beside a tensor- or pipeline-parallel target.
    draft_config = replace(config, model=name, revision=None, quantization=None, tensor_parallel_size=1,
                           pipeline_parallel_size=1,
                           nnodes=1, node_rank=0, dist_init_addr=None)
    source = resolve_model(name)
    backend = make_backend(draft_config, registry, source)
    backend.load(source)
    return backend


def run_worker_node(config: EngineConfig, registry: PluginRegistry | None = None) -> None:
    """Be node ``config.node_rank`` (not 0) of a multi-node engine: start this node's ranks, which load their share
    of the model and run the steps node 0 sends, until node 0 shuts down. Ends the process (SystemExit)."""
    if config.node_rank == 0:
        raise ConfigError("node 0 runs the engine itself, not a worker node")
    source = resolve_model(config.model, config.revision)
    backend = make_backend(config, registry or load_plugins(), source)
    backend.load(source)  # a parallel backend's load on another node raises SystemExit when its ranks end
    raise ConfigError(f"backend {config.backend!r} returned from loading on node {config.node_rank}: it does not "
                      "run worker nodes")


def make_backend(config: EngineConfig, registry: PluginRegistry, source: ModelSource) -> ExecutionBackend:
    """The configured backend with the quantizers its weights need; refused when unavailable or unable to run
    them."""
    # The registry stores every kind's classes as plain types; registering a backend checked it subclasses the
    # backend contract.
    backend_cls = cast(type[ExecutionBackend], registry.get("backend", config.backend).cls)
    caps = backend_cls.capabilities()
    if not caps.available:
        raise PluginError(f"backend {config.backend!r} is unavailable: {caps.unavailable_reason}")
    if config.tensor_parallel_size > 1 and not caps.tensor_parallel:
        raise ConfigError(f"backend {config.backend!r} does not support tensor parallelism "
                          f"(tensor_parallel_size {config.tensor_parallel_size})")
    if config.kv_cache_dtype not in caps.kv_cache_dtypes:
        raise ConfigError(f"backend {config.backend!r} cannot hold a {config.kv_cache_dtype!r} KV cache (it holds: "
                          f"{', '.join(caps.kv_cache_dtypes)})")
    if config.pipeline_parallel_size > 1 and not caps.pipeline_parallel:
        raise ConfigError(f"backend {config.backend!r} does not support pipeline parallelism "
                          f"(pipeline_parallel_size {config.pipeline_parallel_size})")
    methods = source.quantization_methods()
    if config.quantization and methods:
        raise ConfigError(f"{source.name} is already quantized ({', '.join(methods)}): drop --quantization")
    quantizers = {}
    for method in (*methods, *([config.quantization] if config.quantization else [])):
        quantizers[method] = registry.create("quantizer", method)
        if not runs_quantization(caps, method):
            raise PluginError(f"backend {config.backend!r} cannot run {method!r} weights (it accepts: "
                              f"{', '.join(caps.quantization_formats) or 'none'})")
    quantizer = quantizers.get(config.quantization) if config.quantization else None
    return registry.create(
        "backend", config.backend,
        BackendOptions(config.device, config.dtype, quantizer, max_batch_size=config.scheduling.max_num_seqs,
                       max_model_len=config.max_model_len, enforce_eager=config.enforce_eager,
                       kv_cache_dtype=config.kv_cache_dtype,
                       verify_artifact=config.verify_artifact, quantizers=quantizers,
                       tensor_parallel_size=config.tensor_parallel_size,
                       pipeline_parallel_size=config.pipeline_parallel_size, nnodes=config.nnodes,
                       node_rank=config.node_rank, dist_init_addr=config.dist_init_addr))


def _num_blocks_from_memory(config: EngineConfig, backend: ExecutionBackend, max_model_len: int) -> int:
    budget = config.kv_cache_bytes or backend.available_kv_cache_bytes()
    per_block = backend.kv_cache_bytes_per_token() * config.block_size
    # No point holding more than every sequence at full length could use.
    most = config.scheduling.max_num_seqs * -(-max_model_len // config.block_size) + 1
    return max(2, min(budget // per_block, most))
