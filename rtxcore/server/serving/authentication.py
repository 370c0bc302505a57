"""Who sent a request: the configured authenticator plugins, asked in order, and a per-address limit on failures.

``[auth] authenticators`` in the serving config names them (default: ``api-key`` when tenants are configured, none
otherwise: an open server). Every refusal is the same :class:`AuthError` (HTTP 401 with ``WWW-Authenticate``, gRPC
UNAUTHENTICATED): which authenticator refused and why goes to the log, with the source address and never the
credentials. An address that fails ``failure_burst`` times in a row is refused at once (429 with Retry-After, before
any credential is looked at) until its bucket refills at ``failures_per_minute``: guessing keys or tokens from one
address goes no faster than that.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rtxcore.errors import ConfigError, ErrorCode, RequestError
from rtxcore.server.serving.tenants import Tenant, TenantRegistry, TokenBucket

if TYPE_CHECKING:
    from cryptography import x509

    from rtxcore.contracts.authenticator import Authenticator, Credentials
    from rtxcore.registry import PluginRegistry

log = logging.getLogger("rtx.server.auth")

DEFAULT_FAILURES_PER_MINUTE = 30.0
DEFAULT_FAILURE_BURST = 10
# Addresses whose failures are remembered; past it, those whose bucket has refilled are forgotten first.
MAX_TRACKED_ADDRESSES = 10_000
# The reason of a refusal's log line is cut here: a plugin's reason could quote what it was sent.
_MAX_REASON = 200


class AuthError(RequestError):
    """Missing or refused credentials (HTTP 401, gRPC UNAUTHENTICATED). The message never says which part was
    wrong. ``code`` stays OpenAI's ``invalid_api_key``, which its clients map to an authentication error."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.UNAUTHENTICATED, message, reason="invalid_api_key")


class TooManyFailures(RequestError):
    """The source address failed authentication too often (HTTP 429 with Retry-After)."""

    def __init__(self, retry_after_s: float):
        super().__init__(ErrorCode.RESOURCE_EXHAUSTED, "too many failed authentications from this address",
                         retry_after_s=retry_after_s, reason="too_many_auth_failures")


@dataclass(slots=True)
class AuthSettings:
    """The ``[auth]`` table."""

    # None: the default (api-key when tenants are configured).
    authenticators: list[str] | None = None
    # Each authenticator's own settings: the ``[auth.<name>]`` tables.
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures_per_minute: float = DEFAULT_FAILURES_PER_MINUTE
    failure_burst: int = DEFAULT_FAILURE_BURST

    @classmethod
    def from_table(cls, table: Mapping[str, Any] | None) -> AuthSettings:
        """:raises ConfigError: an unknown setting or a wrong value, named."""
        table = dict(table or {})
        settings = cls()
        names = table.pop("authenticators", None)
        if names is not None:
            if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
                raise ConfigError("[auth] authenticators must be a list of authenticator names")
            if len(set(names)) != len(names):
                raise ConfigError("[auth] authenticators names one authenticator twice")
            settings.authenticators = list(names)
        for setting in ("failures_per_minute", "failure_burst"):
            if setting in table:
                value = table.pop(setting)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                    raise ConfigError(f"[auth] {setting} must be a positive number, got {value!r}")
                # A burst is a count of failures: 0.5 would become a bucket of none, and every key then fails.
                if setting == "failure_burst" and not (isinstance(value, int) or value.is_integer()):
                    raise ConfigError(f"[auth] failure_burst must be a whole number of failures, got {value!r}")
                setattr(settings, setting, int(value) if setting == "failure_burst" else float(value))
        for name, options in table.items():
            if not isinstance(options, Mapping):
                raise ConfigError(f"unknown setting {name!r} in [auth] (settings: authenticators, "
                                  "failures_per_minute, failure_burst, and an [auth.<authenticator>] table each)")
            settings.options[name] = dict(options)
        listed = settings.authenticators or []
        for name in settings.options:
            if name not in listed:
                raise ConfigError(f"[auth.{name}] configures an authenticator that [auth] authenticators does not "
                                  f"list ({', '.join(listed) or 'none listed'})")
        return settings


class Authentication:
    def __init__(self, authenticators: Sequence[tuple[str, Authenticator]], tenants: TenantRegistry,
                 failures_per_minute: float = DEFAULT_FAILURES_PER_MINUTE,
                 failure_burst: int = DEFAULT_FAILURE_BURST):
        self.authenticators = list(authenticators)
        self.tenants = tenants
        self.failures_per_minute = failures_per_minute
        self.failure_burst = failure_burst
        schemes = dict.fromkeys(a.scheme for _, a in self.authenticators if a.scheme)
        # RFC 9110 wants a challenge on every 401; with client certificates alone, "Certificate" says what is asked.
        self.challenge = ", ".join(schemes) or "Certificate"
        # What a request without credentials is told to send: bearer keys and tokens, or another plugin's scheme.
        if list(schemes) == ["Bearer"]:
            self.missing_hint = "send 'Authorization: Bearer <key or token>'"
        elif schemes:
            self.missing_hint = f"send credentials of the scheme{'s' if len(schemes) > 1 else ''} {self.challenge}"
        else:
            self.missing_hint = "present a client certificate"
        self._failures: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()

    @property
    def required(self) -> bool:
        return bool(self.authenticators)

    @classmethod
    def from_config(cls, settings: AuthSettings | None, tenants: TenantRegistry,
                    registry: PluginRegistry | None = None) -> Authentication:
        """The authenticators ``settings`` names, built from ``registry`` (loaded when None and needed).

        :raises ConfigError: authenticators without tenants to prove, or tenants no authenticator can prove.
        :raises PluginError: an authenticator that is not registered or fails to build.
        """
        from rtxcore.contracts.authenticator import AuthenticatorContext

        settings = settings or AuthSettings()
        has_keys = any(t.key_hashes for t in tenants.tenants.values())
        default = ["api-key"] if tenants.tenants else []
        names = settings.authenticators if settings.authenticators is not None else default
        if names and registry is None:
            from rtxcore.registry import load_plugins

            registry = load_plugins()
        for name in names:  # first: a misspelt name would make the checks below misleading
            registry.get("authenticator", name)  # type: ignore[union-attr]
        if names and not tenants.tenants:
            raise ConfigError(f"[auth] authenticators ({', '.join(names)}) need tenants to prove: add [tenants.<name>]")
        if tenants.tenants and not names:
            raise ConfigError("[tenants] are configured but [auth] authenticators is empty: nobody could use them")
        if has_keys and "api-key" not in names:
            raise ConfigError("tenants have API keys but [auth] authenticators does not list api-key")
        if names == ["api-key"]:
            keyless = sorted(t.name for t in tenants.tenants.values() if not t.key_hashes)
            if keyless:
                raise ConfigError(f"tenant {keyless[0]!r} has no key (set key_sha256, key_env or RTX_API_KEYS, or "
                                  "add an authenticator that proves it another way to [auth] authenticators)")
        if not names or registry is None:
            return cls([], tenants)
        known = {name: list(t.key_hashes) for name, t in tenants.tenants.items()}
        built = [(name, registry.create("authenticator", name,
                                        AuthenticatorContext(known, dict(settings.options.get(name, {})))))
                 for name in names]
        return cls(built, tenants, settings.failures_per_minute, settings.failure_burst)

    def authenticate(self, credentials: Credentials) -> Tenant | None:
        """The tenant ``credentials`` prove; None on an open server.

        :raises TooManyFailures: the source address failed too often lately (nothing was checked).
        :raises AuthError: no authenticator proves a known tenant.
        """
        if not self.authenticators:
            return None
        address = credentials.peer or "unknown"
        self._check_address(address)
        reason = "no credentials" if _nothing_presented(credentials) else "no authenticator accepts the credentials"
        for name, authenticator in self.authenticators:
            found, refusal = _ask(name, authenticator, credentials)
            if refusal is not None:
                reason = refusal
                break
            if found is not None:
                tenant = self.tenants.tenants.get(found)
                if tenant is not None:
                    return tenant
                reason = f"{name}: names an unknown tenant {found[:64]!r}"
                break
        self._failed(address, reason)
        if _nothing_presented(credentials):
            raise AuthError(f"missing credentials: {self.missing_hint}")
        raise AuthError("invalid credentials")

    def _check_address(self, address: str) -> None:
        with self._lock:
            bucket = self._failures.get(address)
            if bucket is None:
                return
            wait = bucket.wait_for(1, time.monotonic())
        if wait > 0:
            raise TooManyFailures(max(1.0, math.ceil(wait)))

    def _failed(self, address: str, reason: str) -> None:
        log.warning("authentication failed from %s: %s", address, reason[:_MAX_REASON])
        now = time.monotonic()
        with self._lock:
            bucket = self._failures.get(address)
            if bucket is None:
                if len(self._failures) >= MAX_TRACKED_ADDRESSES:
                    self._forget_refilled(now)
                bucket = self._failures[address] = TokenBucket(self.failures_per_minute / 60.0, self.failure_burst,
                                                               updated=now)
            bucket.wait_for(1, now)  # refill up to now before taking
            bucket.take(1)

    def _forget_refilled(self, now: float) -> None:
        for address in [a for a, b in self._failures.items() if b.wait_for(b.capacity, now) == 0]:
            del self._failures[address]
        while len(self._failures) >= MAX_TRACKED_ADDRESSES:  # all still failing: the oldest entries go
            del self._failures[next(iter(self._failures))]


def _ask(name: str, authenticator: Authenticator, credentials: Credentials) -> tuple[str | None, str | None]:
    """(tenant name or None, refusal reason or None). A plugin that raises anything else refuses: failing closed."""
    from rtxcore.contracts.authenticator import AuthenticationFailed

    try:
        found = authenticator.authenticate(credentials)
    except AuthenticationFailed as exc:
        return None, f"{name}: {exc.reason}"
    except Exception as exc:
        # The type only: an exception's message could quote the credentials.
        return None, f"{name} plugin failed: {type(exc).__name__}"
    if found is not None and not isinstance(found, str):
        return None, f"{name} plugin returned {type(found).__name__}, not a tenant name"
    return found, None


def _nothing_presented(credentials: Credentials) -> bool:
    return not (credentials.authorization or credentials.api_key or credentials.client_cert_subject)


def subject_attributes(certificate: x509.Certificate) -> dict[str, str]:
    """A certificate subject's attributes by RFC 4514 name (``CN``, ``O``...); the last of a repeated one wins."""
    return {attribute.rfc4514_attribute_name: str(attribute.value) for attribute in certificate.subject}


def certificate_subject(pem_or_der: bytes) -> dict[str, str] | None:
    """:func:`subject_attributes` of a PEM or DER certificate; None when it cannot be read."""
    from cryptography import x509

    try:
        certificate = (x509.load_pem_x509_certificate(pem_or_der) if pem_or_der.lstrip().startswith(b"-----")
                       else x509.load_der_x509_certificate(pem_or_der))
    except ValueError:
        return None
    return subject_attributes(certificate)
