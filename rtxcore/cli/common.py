"""Options shared by the commands that load a model."""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rtxcore.cli.processor_options import add_processor_options, processor_cli_args, processor_options
from rtxcore.cli.progress import Progress
from rtxcore.cli.speculation import add_speculative_options, speculative_cli_args, speculative_config
from rtxcore.engine.config import EngineConfig
from rtxcore.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rtxcore.server.serve_config import ServeConfigFile


# The commands sample as the API does when a request says nothing (SamplingParams' default, OpenAI's).
TEMPERATURE_HELP = (f"sampling temperature, 0 for greedy (default: {SamplingParams().temperature}, as in the HTTP "
                    "API and OpenAI's)")

# Where the positional MODEL is parsed to; merge_model_argument moves it to ``model``, where --model puts its value.
MODEL_ARG = "model_arg"


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The options of the commands that load a model, and the model as their first positional argument (``rtx serve
    MODEL``, as ``vllm serve MODEL``); a command with positional arguments of its own adds them after this."""
    p.add_argument(MODEL_ARG, nargs="?", type=non_empty, default=None, metavar="MODEL",
                   help="the model, as --model takes it")
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", type=non_empty, default=None,
                   help="smollm2-135m (default), a .gguf file, a Hugging Face directory or Hub id (owner/name: "
                        "from the HF cache, else downloaded; see `rtx pull`), or dummy:<shape>; the same as the "
                        "positional MODEL")
    g.add_argument("--revision", type=non_empty, default=None,
                   help="a Hub id's branch, tag or commit (default: main)")
    g.add_argument("--backend", default="torch", help="execution backend plugin (default: torch)")
    g.add_argument("--scheduler", default="fcfs", help="scheduler plugin (default: fcfs)")
    g.add_argument("--sampler", default="default", help="sampler plugin (default: default)")
    g.add_argument("--eviction-policy", default="lru", help="KV-cache eviction policy plugin (default: lru)")
    g.add_argument("--device", default="auto", help="cpu, cuda or auto")
    g.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    g.add_argument("--quantization", default=None, metavar="METHOD",
                   help="quantize the float weights as they load, by plain rounding (int8, int4, fp8 or an installed "
                        "quantizer plugin); a checkpoint written by `rtx quantize` needs none")
    g.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                   help="split every layer across N ranks (tensor parallelism)")
    g.add_argument("--pipeline-parallel-size", type=positive_int, default=1, metavar="M",
                   help="split the layers into M stages, each on its own ranks (pipeline parallelism); the model "
                        "then runs on N x M processes")
    n = p.add_argument_group("several nodes (node 0 runs the engine; start the same command on every node)")
    n.add_argument("--nnodes", type=positive_int, default=1, metavar="N",
                   help="nodes the tensor x pipeline ranks are spread over, the same number on each (default: 1)")
    n.add_argument("--node-rank", type=int, default=0, metavar="I",
                   help="this node's index, 0..N-1; node 0 serves, the others only run their ranks (default: 0)")
    n.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="where the ranks of every node meet: a free port on node 0, reachable from the others")
    g.add_argument("--chat-template", type=chat_template_file, default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the model's own")
    g.add_argument("--max-model-len", type=positive_int, default=None, help="longest prompt + output accepted")
    g.add_argument("--num-kv-blocks", type=bounded_int(2, 2**31 - 1), default=None,
                   help="KV-cache blocks (default: sized from memory)")
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="token budget per step")
    g.add_argument("--max-num-seqs", type=positive_int, default=256, help="most requests running at once")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    g.add_argument("--enforce-eager", action="store_true", help="run every step eagerly (no CUDA graphs)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="the KV cache's dtype: auto (the model's) or fp8 (e4m3: twice the blocks, half the "
                        "attention's reads, slightly less accurate)")
    add_processor_options(g)
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="read each step's tokens before scheduling the next (on accelerators the default overlaps "
                        "the two)")
    t = p.add_argument_group("KV cache tiers")
    t.add_argument("--kv-host-bytes", type=byte_size, default=0, metavar="SIZE",
                   help="host memory for prefix-cache blocks the device evicts, e.g. 8GiB (default: 0, none)")
    t.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="directory for a disk tier under the host tier, kept across restarts (warm cache)")
    t.add_argument("--kv-disk-bytes", type=byte_size, default=8 << 30, metavar="SIZE",
                   help="most bytes the disk tier holds (default: 8GiB)")
    t.add_argument("--kv-host-eviction-policy", default=None, metavar="NAME",
                   help="eviction policy plugin of the host tier (default: --eviction-policy)")
    t.add_argument("--kv-disk-eviction-policy", default=None, metavar="NAME",
                   help="eviction policy plugin of the disk tier (default: --eviction-policy)")
    t.add_argument("--kv-snapshot-interval", type=finite_float, default=60.0, metavar="SECONDS",
                   help="with --kv-disk-dir, write the prefix cache there this often for warm restarts; 0: only on "
                        "shutdown (default: 60)")
    add_speculative_options(p)


def merge_model_argument(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The positional MODEL, where the command has one and it was given, becomes ``args.model``: the two spellings
    are one setting. Both, naming different models, is a usage error (one line, exit code 2). A --model that only
    repeats the command's default (a preset's model) gives way to the positional one."""
    if not hasattr(args, MODEL_ARG):
        return
    positional = getattr(args, MODEL_ARG)
    delattr(args, MODEL_ARG)
    if positional is None:
        return
    flag = args.model
    if flag is not None and flag != positional and flag != parser.get_default("model"):
        parser.error(f"two models given, {positional!r} and --model {flag!r}: give one")
    args.model = positional


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def byte_size(text: str) -> int:
    """``4096``, ``512MiB``, ``8GB``...: a byte count (argparse type; a bad value exits with code 2)."""
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number):].lower()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4096, 512MiB, 8GB)") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite size")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return int(value)


def finite_float(text: str) -> float:
    """A float that is neither inf nor nan (argparse type): those passed every ``<= 0`` check and then broke a
    timer or a ceil far from the option that set them."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type)."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not at least 1")
    return value


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high``, the bound named in the error."""
    def parse(text: str) -> int:
        value = _integer(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} is not at least {low:,}")
        if value > high:
            raise argparse.ArgumentTypeError(f"{text!r} is more than {high:,}")
        return value
    return parse


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def non_empty(text: str) -> str:
    """A string with something in it (argparse type): an empty --model or --revision read as none given, and the
    command went on with the default model or branch (or failed far away, as a network error)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must not be empty, got {text!r}")
    return text


def http_url(text: str) -> str:
    """An ``http(s)://HOST[:PORT]`` URL (argparse type), parsed as httpx will connect: an empty one read as none
    given (``rtx chat`` then loaded a model here), a bad port failed deep in a task group."""
    import httpx

    try:
        url = httpx.URL(text)
        ok = url.scheme in ("http", "https") and bool(url.host) and (url.port is None or 0 < url.port <= 65535)
    except (httpx.InvalidURL, ValueError):
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"must start with http:// or https:// and name HOST[:PORT], a port in "
                                         f"[1, 65535]; got {text!r}")
    return text


def chat_template_file(text: str) -> str:
    """A readable chat template file whose template parses (argparse type: a one-line error before anything
    loads); its path."""
    from rtxcore.errors import ConfigError
    from rtxcore.tokenizer.chat_template import check_chat_template

    try:
        source = Path(text).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {exc}") from None
    try:
        check_chat_template(source)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"{text}: {exc}") from None
    return text


def output_file(text: str) -> str:
    """A file path that can be written (argparse type): checked before a long run, not after it, when the results
    would be lost. Tried for real (opened for appending, a new file removed again): permission bits alone do not
    tell, as root, that ``/proc/x`` cannot be made."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: directory {str(parent)!r} does not exist")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {exc.strerror or exc}") from None
    return str(path)


def output_path(text: str) -> Path:
    """:func:`output_file`, as a Path."""
    return Path(output_file(text))


def output_dir(text: str) -> Path:
    """A directory that exists or can be made, and where files can be written (argparse type); tried for real, with
    a temporary file in it or in its nearest existing parent."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    existing = next(p for p in (path, *path.parents) if p.exists())
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write in {str(existing)!r}: {exc.strerror or exc}") from None
    return path


def engine_cli_args(args: argparse.Namespace) -> list[str]:
    """The engine options of ``args`` as command-line arguments (to start ``rtx serve`` with the same engine)."""
    out = ["--backend", args.backend, "--scheduler", args.scheduler, "--sampler", args.sampler,
           "--eviction-policy", args.eviction_policy, "--device", args.device, "--dtype", args.dtype,
           "--block-size", str(args.block_size), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-num-seqs", str(args.max_num_seqs), "--tensor-parallel-size", str(args.tensor_parallel_size),
           "--pipeline-parallel-size", str(args.pipeline_parallel_size), "--nnodes", str(args.nnodes),
           "--node-rank", str(args.node_rank), "--kv-cache-dtype", args.kv_cache_dtype]
    for flag, value in (("--model", args.model), ("--revision", args.revision), ("--max-model-len", args.max_model_len),
                        ("--dist-init-addr", args.dist_init_addr),
                        ("--num-kv-blocks", args.num_kv_blocks), ("--quantization", args.quantization)):
        if value is not None:
            out += [flag, str(value)]
    if args.no_prefix_caching:
        out.append("--no-prefix-caching")
    if args.enforce_eager:
        out.append("--enforce-eager")
    if args.no_async_scheduling:
        out.append("--no-async-scheduling")
    out += ["--kv-host-bytes", str(args.kv_host_bytes), "--kv-disk-bytes", str(args.kv_disk_bytes),
            "--kv-snapshot-interval", str(args.kv_snapshot_interval)]
    for flag, value in (("--kv-disk-dir", args.kv_disk_dir), ("--chat-template", args.chat_template),
                        ("--kv-host-eviction-policy", args.kv_host_eviction_policy),
                        ("--kv-disk-eviction-policy", args.kv_disk_eviction_policy)):
        if value is not None:
            out += [flag, value]
    return out + processor_cli_args(args) + speculative_cli_args(args)


def engine_config(args: argparse.Namespace, config_file: ServeConfigFile | None = None) -> EngineConfig:
    """The engine settings of the command line, over those of ``config_file`` (``rtx serve --config``) where it has
    them."""
    from rtxcore.contracts.scheduler import SchedulerConfig
    from rtxcore.files import check_directory_path

    if args.kv_disk_dir:
        # Its last directory is made if missing, not a chain of them: a typo in a mount point would otherwise put
        # the disk tier (up to --kv-disk-bytes) on whatever disk holds the first directory that exists.
        check_directory_path(args.kv_disk_dir, "--kv-disk-dir", make_parents=False)
    return EngineConfig(
        model=args.model, revision=args.revision,
        chat_template=Path(args.chat_template).expanduser().read_text() if args.chat_template else None,
        backend=args.backend, scheduler=args.scheduler, sampler=args.sampler,
        eviction_policy=args.eviction_policy, device=args.device, dtype=args.dtype, quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        nnodes=args.nnodes, node_rank=args.node_rank, dist_init_addr=args.dist_init_addr,
        max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching, enforce_eager=args.enforce_eager,
        kv_cache_dtype=args.kv_cache_dtype, async_scheduling=False if args.no_async_scheduling else None,
        kv_host_bytes=args.kv_host_bytes, kv_disk_dir=args.kv_disk_dir, kv_disk_bytes=args.kv_disk_bytes,
        kv_host_eviction_policy=args.kv_host_eviction_policy, kv_disk_eviction_policy=args.kv_disk_eviction_policy,
        kv_snapshot_interval_s=args.kv_snapshot_interval,
        scheduling=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs),
        speculative=speculative_config(args, config_file),
        logits_processor_options=processor_options(args, config_file),
    )


def run_worker_node(config: EngineConfig) -> int:
    """``--node-rank`` above 0: run this node's ranks for node 0 until it shuts down, then exit with their status."""
    from rtxcore.engine.components import run_worker_node as run_node

    per_node = config.world_size // config.nnodes
    first = config.node_rank * per_node
    sys.stderr.write(f"node {config.node_rank} of {config.nnodes}: running ranks {first}..{first + per_node - 1} "
                     f"for node 0 at {config.dist_init_addr}\n")
    try:
        run_node(config)
    except SystemExit as done:
        return int(done.code or 0)
    return 0


def _announced(line: str, progress: Progress) -> Callable[[int, int], None]:
    """``progress``, with ``line`` written before its first report."""
    announced = False

    def report(done: int, total: int) -> None:
        nonlocal announced
        if not announced:
            announced = True
            sys.stderr.write(line + "\n")
        progress(done, total)
    return report


def load_engine(config: EngineConfig, quiet: bool = False):
    from rtxcore.engine.llm import LLM
    from rtxcore.models.resolve import resolve_model

    if config.node_rank > 0:
        # Not an engine: this node only runs ranks (generate and bench start here on every node).
        raise SystemExit(run_worker_node(config))

    start = time.monotonic()
    # The model is resolved first, and the loading line waits for the first weight: a model that cannot load (a
    # missing file, a bad header, an unknown shape) or a backend that refuses its settings leaves the one line of
    # its error, with no progress line before it.
    source = resolve_model(config.model, config.revision)
    progress = None
    if not quiet:
        progress = _announced(f"loading {config.model or source.name} on backend {config.backend}...",
                              Progress("weights"))
    engine = LLM(config, source=source, progress=progress)
    if not quiet:
        core = engine.core
        sys.stderr.write(f"loaded {core.source.name} ({core.model_config.num_params / 1e6:.0f}M parameters) on "
                         f"{core.backend.device} in {time.monotonic() - start:.1f}s; KV cache: "
                         f"{core.kv_cache.num_blocks} blocks of {config.block_size} tokens\n")
    return engine
