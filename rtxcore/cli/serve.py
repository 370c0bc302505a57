"""``rtx serve``: the OpenAI-compatible HTTP server (and gRPC) on one model."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Collection

from rtxcore.cli.common import (
    add_engine_options,
    bounded_int,
    byte_size,
    engine_config,
    finite_float,
    positive_int,
    run_worker_node,
)


def add_parser(sub) -> None:
    from rtxcore.server.serving.settings import MAX_BODY_BYTES, MIN_JOURNAL_COMPACT_BYTES, ServeSettings

    d = ServeSettings()
    p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible) and gRPC",
                       usage="%(prog)s [options] [MODEL]",
                       description="Serve a model over HTTP (OpenAI-compatible API) and gRPC: `rtx serve MODEL`, as "
                                   "`vllm serve MODEL`. With no arguments it serves the default model on 127.0.0.1.")
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host, help=f"address to listen on (default: {d.host})")
    g.add_argument("--port", type=port_number, default=d.port,
                   help=f"HTTP port; 0 picks a free one (default: {d.port})")
    g.add_argument("--grpc-port", type=port_number, default=d.grpc_port,
                   help=f"gRPC port; 0 picks a free one (default: {d.grpc_port})")
    g.add_argument("--no-grpc", action="store_true", help="do not start the gRPC server")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model id clients use, then any other names requests may give (default: the model's name, "
                        "e.g. smollm2-135m)")
    g.add_argument("--request-timeout", type=finite_float, default=d.request_timeout_s,
                   help=f"seconds before a request is aborted (default: {d.request_timeout_s:g})")
    g.add_argument("--max-body-bytes", type=bounded_int(1, MAX_BODY_BYTES), default=d.max_body_bytes,
                   help=f"largest request body accepted (default: {d.max_body_bytes})")
    g.add_argument("--max-active-requests", type=positive_int, default=d.max_active_requests,
                   help=f"requests in flight before answering 429 (default: {d.max_active_requests})")
    g.add_argument("--shutdown-grace", type=finite_float, default=d.shutdown_grace_s,
                   help=f"seconds running requests get to finish on SIGINT/SIGTERM (default: {d.shutdown_grace_s:g})")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="TOML file with [lanes], [scheduler], [brownout], [tenants], [auth] (docs/serving.md) and "
                        "[speculative] (docs/plugins.md); flags given override its settings")
    g.add_argument("--signing-public-key", default=d.signing_public_key, metavar="PEM",
                   help="EC public key models are verified against (`rtx sign`); an unsigned model then loads "
                        "with a warning, a wrongly signed one is refused")
    g.add_argument("--require-signed-models", action="store_true", default=d.require_signed_models,
                   help="refuse to load a model without a valid signature (needs --signing-public-key)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (repeat for several keys; tenant 'default'). Visible "
                        "in the process list: in production prefer RTX_API_KEYS or [tenants] in --config")
    tls = p.add_argument_group("TLS (both servers; docs/serving.md)")
    tls.add_argument("--ssl-certfile", default=None, metavar="PEM", help="serve HTTPS and gRPC over TLS with this "
                     "certificate chain (needs --ssl-keyfile)")
    tls.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the certificate's private key")
    tls.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                     help="CA certificates client certificates are verified against (mutual TLS)")
    tls.add_argument("--ssl-cert-reqs", default="none", choices=["none", "required"],
                     help="'required': every client presents a certificate the CA signed; the mtls authenticator "
                          "([auth]) maps its subject to a tenant (default: none)")
    g.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN",
                   help="answer browsers from ORIGIN (CORS, with preflight); repeat or separate by commas; '*' for "
                        "any (default: none)")
    g.add_argument("--forwarded-allow-ips", action="append", default=None, metavar="IPS",
                   help="proxies (addresses, networks such as 10.0.0.0/8, or '*') whose X-Forwarded-For names the "
                        "client, for per-address limits and logs; repeat or separate by commas (default: 127.0.0.1). "
                        "Behind a load balancer or Ingress, name it: else every client shares its address")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log level on stderr (default: info)")
    durable = p.add_argument_group("durable restarts (docs/serving.md)")
    durable.add_argument("--state-dir", default=d.state_dir, metavar="DIR",
                         help="keep a request journal under DIR/journal: accepted requests survive a crash or "
                              "restart and streams are resumable (GET /v1/streams/{id}); off without it")
    durable.add_argument("--journal-retention", type=finite_float, default=None, metavar="SECONDS",
                         help="how long finished requests stay resumable and in the journal "
                              f"(default: {d.journal_retention_s:g})")
    durable.add_argument("--journal-compact-bytes", type=byte_size, default=None,
                         metavar="SIZE", help="compact the journal once it is this large and mostly requests past "
                                              f"retention; at least {MIN_JOURNAL_COMPACT_BYTES >> 10}KiB "
                                              f"(default: {d.journal_compact_min_bytes >> 20}M)")
    fleet = p.add_argument_group("fleet view: the dashboard's replicas and autoscaling panel (docs/serving.md)")
    fleet.add_argument("--fleet-peers", default=None, metavar="HOSTS",
                       help="comma-separated host[:port] whose /metrics the panel reads (this server's port when "
                            "none is given); a name may resolve to many pods, as the Helm chart's headless Service")
    fleet.add_argument("--fleet-interval", type=finite_float, default=10.0, metavar="SECONDS",
                       help="how often the peers are read (default: 10)")
    fleet.add_argument("--autoscale-queue-depth", type=finite_float, default=None, metavar="N",
                       help="the autoscaler's target of requests waiting per pod (the chart's targetQueueDepth)")
    fleet.add_argument("--autoscale-ttft-p95", type=finite_float, default=None, metavar="SECONDS",
                       help="the autoscaler's target p95 time to first token per pod (targetTTFTP95Seconds)")
    fleet.add_argument("--autoscale-replicas", default=None, metavar="MIN:MAX",
                       help="the autoscaler's replica bounds (minReplicas:maxReplicas; default 1:no limit)")
    fleet.add_argument("--autoscale-mode", default=None, choices=["hpa", "keda"],
                       help="the chart's autoscaling.mode: hpa averages the pods' p95s, keda takes one p95 over all "
                            "pods (default: hpa)")
    fleet.add_argument("--autoscale-lane", default=None, metavar="LANE",
                       help="the p95 of this lane's requests only (the chart's latencyLane; default: all lanes)")
    add_engine_options(p)
    p.set_defaults(run=run)


def port_number(text: str) -> int:
    """A TCP port, 0 (pick a free one) to 65535 (argparse type: the error names the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port in [0, 65535]")
    return value


def fleet_settings(args: argparse.Namespace, lanes: Collection[str] | None = None):
    """The --fleet-*/--autoscale-* flags as FleetSettings; None without --fleet-peers.
    :param lanes: the lanes configured (default: every lane), one of which --autoscale-lane must name.
    :raises ConfigError: a malformed value, or autoscaling targets without peers to read."""
    from rtxcore.errors import ConfigError
    from rtxcore.lanes import LANE_NAMES
    from rtxcore.server.fleet import FleetSettings, parse_autoscale_replicas

    given = [flag for flag, value in (("--autoscale-queue-depth", args.autoscale_queue_depth),
                                      ("--autoscale-ttft-p95", args.autoscale_ttft_p95),
                                      ("--autoscale-replicas", args.autoscale_replicas),
                                      ("--autoscale-lane", args.autoscale_lane),
                                      ("--autoscale-mode", args.autoscale_mode)) if value is not None]
    if args.fleet_peers is None:
        if given:
            raise ConfigError(f"{given[0]} needs --fleet-peers (the pods whose signals it is compared with)")
        return None
    peers = tuple(p.strip() for p in args.fleet_peers.split(","))
    if not all(peers):
        raise ConfigError(f"--fleet-peers {args.fleet_peers!r} has an empty entry: expected comma-separated "
                          "host or host:port")
    lanes = LANE_NAMES if lanes is None else lanes
    if args.autoscale_lane is not None and args.autoscale_lane not in lanes:
        raise ConfigError(f"--autoscale-lane {args.autoscale_lane!r} is not a lane (lanes: {', '.join(lanes)})")
    low, high = parse_autoscale_replicas(args.autoscale_replicas) if args.autoscale_replicas else (1, None)
    return FleetSettings(peers=peers,
                         target_queue_depth=args.autoscale_queue_depth, target_ttft_p95_s=args.autoscale_ttft_p95,
                         min_replicas=low, max_replicas=high, latency_lane=args.autoscale_lane,
                         interval_s=args.fleet_interval, mode=args.autoscale_mode or "hpa")


def run(args: argparse.Namespace) -> int:
    from rtxcore.cli.progress import Progress
    from rtxcore.contracts import Scheduler
    from rtxcore.errors import ConfigError
    from rtxcore.models.resolve import resolve_model
    from rtxcore.registry import load_plugins
    from rtxcore.server.launcher import serve
    from rtxcore.server.serve_config import load_serve_config
    from rtxcore.server.serving.authentication import Authentication
    from rtxcore.server.serving.runtime import ServeSettings, ServingRuntime
    from rtxcore.server.serving.settings import TlsSettings
    from rtxcore.server.serving.tenants import TenantRegistry

    tls = None
    if args.ssl_certfile or args.ssl_keyfile:
        if not (args.ssl_certfile and args.ssl_keyfile):
            raise ConfigError("TLS needs both --ssl-certfile and --ssl-keyfile")
        tls = TlsSettings(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)
    elif args.ssl_ca_certs or args.ssl_cert_reqs != "none":
        raise ConfigError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and --ssl-keyfile")
    config_file = load_serve_config(args.config)
    journal = {"journal_retention_s": args.journal_retention, "journal_compact_min_bytes": args.journal_compact_bytes}
    for flag, value in (("--journal-retention", args.journal_retention),
                        ("--journal-compact-bytes", args.journal_compact_bytes)):
        if value is not None and args.state_dir is None:
            raise ConfigError(f"{flag} needs --state-dir: without it there is no journal")
    settings = ServeSettings(
        host=args.host, port=args.port, grpc_port=None if args.no_grpc else args.grpc_port,
        max_body_bytes=args.max_body_bytes, request_timeout_s=args.request_timeout,
        max_active_requests=args.max_active_requests, shutdown_grace_s=args.shutdown_grace,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        served_model_aliases=tuple(args.served_model_name[1:]) if args.served_model_name else (),
        signing_public_key=args.signing_public_key,
        require_signed_models=args.require_signed_models, state_dir=args.state_dir,
        **{k: v for k, v in journal.items() if v is not None},
        allowed_origins=_comma_list(args.allowed_origins),
        forwarded_allow_ips=_comma_list(args.forwarded_allow_ips) if args.forwarded_allow_ips else None,
        tls=tls, fleet=fleet_settings(args, config_file.lanes))
    tenants = TenantRegistry.from_config(config_file.tenants, api_keys=args.api_key or ())
    auth = Authentication.from_config(config_file.auth, tenants)
    if any(name == "mtls" for name, _ in auth.authenticators) and (tls is None or tls.cert_reqs != "required"):
        raise ConfigError("the mtls authenticator needs client certificates: --ssl-certfile, --ssl-keyfile, "
                          "--ssl-ca-certs and --ssl-cert-reqs required")
    config = engine_config(args, config_file)
    if config.node_rank > 0:
        return run_worker_node(config)  # this node only runs ranks: node 0 serves
    if args.state_dir and config.kv_disk_dir is None and config.enable_prefix_caching:
        # Durable state includes the prefix cache: a restart starts warm from the disk tier's snapshot.
        config.kv_disk_dir = os.path.join(args.state_dir, "kv")
    config.scheduling.lanes = config_file.lanes
    config.scheduling.options = config_file.scheduler_options
    # [scheduler] and [brownout] are the scheduler plugin's to read: asked now, a typo fails before the weights load.
    scheduler = load_plugins().get("scheduler", config.scheduler).cls
    if issubclass(scheduler, Scheduler):  # always: registration checks the contract
        scheduler.check_options(config.scheduling.options)
    # A model that cannot be found (or downloaded) fails now, before the server starts listening.
    resolve_model(config.model, config.revision)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.kv_disk_dir and not os.path.isdir(args.kv_disk_dir):
        logging.getLogger("rtx.server").info("--kv-disk-dir %s does not exist: making it", args.kv_disk_dir)
    if auth.required:
        logging.getLogger("rtx.server").info("authentication required (%s): %d tenants (%s)",
                                             ", ".join(name for name, _ in auth.authenticators), len(tenants.tenants),
                                             ", ".join(sorted(tenants.tenants)))
    # The bar of `rtx generate`, unless the log is asked to keep to warnings.
    progress = Progress("weights") if args.log_level in ("debug", "info") else None
    return serve(ServingRuntime(config, settings, tenants, progress=progress, auth=auth))


def _comma_list(items: list[str] | None) -> tuple[str, ...]:
    """A repeatable option's values, each of which may hold several separated by commas."""
    return tuple(x.strip() for item in items or () for x in item.split(",") if x.strip())
