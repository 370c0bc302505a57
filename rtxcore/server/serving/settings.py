"""The server's own settings (listen address, limits, durability), apart from the engine's: a module of its own so
that ``rtx serve --help`` can show their defaults without importing the engine."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rtxcore.errors import ConfigError
from rtxcore.files import check_directory_path
from rtxcore.server.serving.proxies import TrustedProxies

if TYPE_CHECKING:
    from rtxcore.server.fleet import FleetSettings

# --ssl-cert-reqs: whether clients must present a certificate the CA (--ssl-ca-certs) signed. There is no "optional":
# gRPC's Python server can only not ask for one or require it, and both servers take the same setting.
CERT_REQS = ("none", "required")
# The smallest --journal-compact-bytes. A request's records (its accept record, then one per batch of tokens) run to
# kilobytes: a compaction below this rewrites and fsyncs the file to win back next to nothing, and at 0 an empty
# journal counts as "mostly garbage" and is rewritten on every sync (5 times a second).
MIN_JOURNAL_COMPACT_BYTES = 64 << 10
# A request body or gRPC message: gRPC takes its limit as a signed 32-bit int.
MAX_BODY_BYTES = 2**31 - 1


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """TLS for the HTTP and gRPC servers alike (PEM files); with ``cert_reqs="required"``, mutual TLS."""

    certfile: str
    keyfile: str
    # CA certificates client certificates are verified against; needed when they are required.
    ca_certs: str | None = None
    cert_reqs: str = "none"

    def __post_init__(self) -> None:
        if self.cert_reqs not in CERT_REQS:
            raise ConfigError(f"--ssl-cert-reqs must be one of {', '.join(CERT_REQS)}, got {self.cert_reqs!r}")
        if self.cert_reqs == "required" and not self.ca_certs:
            raise ConfigError("--ssl-cert-reqs required needs --ssl-ca-certs (the CA client certificates are "
                              "verified against)")
        for flag, path in (("--ssl-certfile", self.certfile), ("--ssl-keyfile", self.keyfile),
                           ("--ssl-ca-certs", self.ca_certs)):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{flag} {path!r} is not a readable file")
        if self.certfile and self.keyfile:
            # Loaded once here so that a file that is not PEM, or a key that does not match the certificate, is
            # named now; the servers' own errors (OpenSSL's "PEM lib", gRPC's "cannot listen") name neither file.
            # An empty passphrase: an encrypted key fails here instead of prompting (neither server takes one).
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            try:
                context.load_cert_chain(self.certfile, self.keyfile, password=b"")
            except (ssl.SSLError, OSError) as e:
                raise ConfigError(f"--ssl-certfile {self.certfile!r} and --ssl-keyfile {self.keyfile!r} are not a "
                                  f"PEM certificate chain and its private key (unencrypted): {e}") from None
        if self.ca_certs:
            # Both servers load it only as they start: uvicorn's error would not name it, and gRPC's C core prints
            # lines of its own and then blames the port.
            ca_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:
                ca_context.load_verify_locations(cafile=self.ca_certs)
            except (ssl.SSLError, OSError) as e:
                raise ConfigError(f"--ssl-ca-certs {self.ca_certs!r} is not a file of PEM CA certificates: "
                                  f"{e}") from None
            if not ca_context.cert_store_stats()["x509"]:  # only revocation lists: gRPC would refuse it
                raise ConfigError(f"--ssl-ca-certs {self.ca_certs!r} holds no certificate (only revocation lists)")

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        """(key, certificate chain, CA certificates or None) as PEM bytes, as gRPC takes them."""
        return (Path(self.keyfile).read_bytes(), Path(self.certfile).read_bytes(),
                Path(self.ca_certs).read_bytes() if self.ca_certs else None)


@dataclass(slots=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    # None disables the gRPC server.
    grpc_port: int | None = 50051
    # Largest accepted HTTP request body.
    max_body_bytes: int = 8 << 20
    # A request still running after this long is aborted (HTTP 504 / gRPC DEADLINE_EXCEEDED).
    request_timeout_s: float = 600.0
    # Requests admitted but not finished; beyond this the server answers 429 with Retry-After.
    max_active_requests: int = 1024
    # On SIGINT/SIGTERM: stop accepting, let running streams finish for this long, then exit.
    shutdown_grace_s: float = 30.0
    # Name served as the model id; None uses the model source's name.
    served_model_name: str | None = None
    # Further names requests may give for the model (`--served-model-name NAME ALIAS...`, as in vLLM).
    served_model_aliases: tuple[str, ...] = ()
    # PEM public key the model's signature is checked against before loading (rtxcore.provenance.signing).
    signing_public_key: str | None = None
    # Refuse a model without a valid signature; needs signing_public_key.
    require_signed_models: bool = False
    # Where durable state lives (the request journal under journal/); None turns durable restarts off.
    state_dir: str | None = None
    # How long finished requests stay resumable (GET /v1/streams/{id}, Idempotency-Key) and in the journal.
    journal_retention_s: float = 600.0
    # The journal is compacted once it is at least this large (and mostly requests past retention).
    journal_compact_min_bytes: int = 4 << 20
    # Browser origins answered with CORS headers (and preflight); "*" for any; empty: no CORS.
    allowed_origins: tuple[str, ...] = ()
    # The proxies (addresses or networks, "*" for any) whose X-Forwarded-For names the client: the address that
    # per-address limits (failed authentications) and logs see. None: uvicorn's default, 127.0.0.1 only.
    forwarded_allow_ips: tuple[str, ...] | None = None
    # TLS (and mutual TLS) for both servers; None serves plain text.
    tls: TlsSettings | None = None
    # The peers whose /metrics the dashboard's autoscaling panel reads (rtxcore.server.fleet); None: no panel.
    fleet: FleetSettings | None = None

    def __post_init__(self) -> None:
        # Named by the flags that set them: the fields' names mean nothing to someone running `rtx serve`.
        for name, flag in (("max_body_bytes", "--max-body-bytes"), ("request_timeout_s", "--request-timeout"),
                           ("max_active_requests", "--max-active-requests")):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{flag} must be positive, got {getattr(self, name)}")
        if self.max_body_bytes > MAX_BODY_BYTES:
            raise ConfigError(f"--max-body-bytes must be at most {MAX_BODY_BYTES} (gRPC's largest message), got "
                              f"{self.max_body_bytes}")
        if self.journal_retention_s < 0:
            raise ConfigError(f"journal_retention_s must be >= 0, got {self.journal_retention_s}")
        if self.journal_compact_min_bytes < MIN_JOURNAL_COMPACT_BYTES:
            raise ConfigError(f"--journal-compact-bytes must be at least {MIN_JOURNAL_COMPACT_BYTES >> 10}KiB "
                              f"({MIN_JOURNAL_COMPACT_BYTES}), got {self.journal_compact_min_bytes}")
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"--shutdown-grace must be >= 0, got {self.shutdown_grace_s}")
        names = [self.served_model_name] if self.served_model_name is not None else []
        for name in names + list(self.served_model_aliases):
            if not name.strip():
                raise ConfigError("--served-model-name: a model name must not be empty or blank")
        if self.forwarded_allow_ips is not None:
            TrustedProxies(self.forwarded_allow_ips)  # refuses an entry that is no address or network
        if self.state_dir:
            # Only the last directory is made, as for --kv-disk-dir: a typo in a mount point must not put the
            # journal on the container's own disk, where a restart loses it.
            check_directory_path(self.state_dir, "--state-dir", make_parents=False)
        self.signing_policy()  # a missing key file or strict mode without a key fails here

    def signing_policy(self):
        from rtxcore.provenance.signing import SigningPolicy

        return SigningPolicy(self.signing_public_key, self.require_signed_models)
