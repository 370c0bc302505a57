"""Tenants: their API keys, per-tenant rate limits and concurrency caps, lane entitlements and cache isolation.

Keys are never kept in clear: a config file names a key by its SHA-256 (``key_sha256``) or by an environment
variable holding it (``key_env``), and keys read from the environment are hashed at start-up. Nothing here logs a key
or a hash. Which tenant sent a request is the authenticators' answer (``authentication.py``): the ``api-key`` one
compares a presented key with these digests; a tenant proved by a token or a certificate needs no key.

With no tenant configured the server runs unauthenticated: every request belongs to no tenant and has no limits.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from rtxcore import envs
from rtxcore.contracts.authenticator import key_digest
from rtxcore.errors import ConfigError, ErrorCode, InvalidRequestError, RequestError
from rtxcore.lanes import DEFAULT_LANE, LANE_NAMES

# Environment variable with keys of tenants: "name=key,other=key2" (e.g. from a Kubernetes Secret).
KEYS_ENV = envs.RTX_API_KEYS.name
# The tenant of keys given without one (--api-key): a server with a single key needs no tenant configuration.
DEFAULT_TENANT = "default"
_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class NotEntitled(RequestError):
    """The tenant may not use the lane it asked for (HTTP 403, gRPC PERMISSION_DENIED)."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.PERMISSION_DENIED, message, param="lane", reason="not_entitled")


class RateLimited(RequestError):
    """A tenant limit is reached (HTTP 429 with Retry-After); ``limit`` says which one (for metrics)."""

    def __init__(self, message: str, retry_after_s: float, limit: str):
        super().__init__(ErrorCode.RESOURCE_EXHAUSTED, message, retry_after_s=retry_after_s, reason="rate_limited")
        self.limit = limit


@dataclass(slots=True)
class TokenBucket:
    """``rate`` units per second, holding at most ``capacity``; starts full."""

    rate: float
    capacity: float
    level: float = -1.0
    updated: float = 0.0

    def __post_init__(self) -> None:
        if self.level < 0:
            self.level = self.capacity

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` is available (0: available now); inf if it exceeds the capacity."""
        self._refill(now)
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: float) -> None:
        self.level -= amount

    def give_back(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)


@dataclass(slots=True)
class Tenant:
    name: str
    key_hashes: list[bytes]
    lanes: tuple[str, ...] = LANE_NAMES
    default_lane: str = DEFAULT_LANE
    requests_per_second: float | None = None
    # Requests that may arrive at once after a quiet spell (the request bucket's size).
    burst: int | None = None
    # Prompt plus max_tokens of admitted requests; what a request did not generate is given back when it ends.
    tokens_per_minute: int | None = None
    max_concurrency: int | None = None
    # Limit state, guarded by the registry's lock.
    _requests: TokenBucket | None = field(default=None, repr=False)
    _tokens: TokenBucket | None = field(default=None, repr=False)
    _active: int = 0

    def __post_init__(self) -> None:
        now = time.monotonic()
        if self.requests_per_second is not None:
            self._requests = TokenBucket(self.requests_per_second, self.burst or max(1, math.ceil(
                self.requests_per_second)), updated=now)
        if self.tokens_per_minute is not None:
            self._tokens = TokenBucket(self.tokens_per_minute / 60.0, self.tokens_per_minute, updated=now)

    def lane_for(self, asked: str | None) -> str:
        """The lane a request runs in: the one it asked for if entitled, else its tenant's default."""
        lane = asked or self.default_lane
        if lane not in self.lanes:
            raise NotEntitled(f"tenant {self.name!r} is not entitled to the {lane} lane "
                              f"(entitled: {', '.join(self.lanes)})")
        return lane


@dataclass(slots=True)
class Lease:
    """What one admitted request took from its tenant's limits; :meth:`TenantRegistry.release` gives it back."""

    tenant: Tenant | None
    num_requests: int
    reserved_tokens: int
    released: bool = False


class TenantRegistry:
    def __init__(self, tenants: list[Tenant]):
        self.tenants = {t.name: t for t in tenants}
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, table: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None,
                    api_keys: Sequence[str] = ()) -> TenantRegistry:
        """Tenants from ``[tenants.<name>]`` tables plus :data:`KEYS_ENV`, plus ``api_keys`` (``rtx serve
        --api-key``, as in vLLM) for a tenant named :data:`DEFAULT_TENANT`.

        :raises ConfigError: an invalid name, setting, key reference or hash.
        """
        environ = os.environ if environ is None else environ
        tenants: dict[str, Tenant] = {}
        for name, values in (table or {}).items():
            tenants[name] = _tenant_from_table(name, values, environ)
        pairs = _env_keys(envs.RTX_API_KEYS.get(environ))
        if any(not key for key in api_keys):
            raise ConfigError("--api-key must not be empty")
        for name, key in [*pairs, *((DEFAULT_TENANT, key) for key in api_keys)]:
            if name in tenants:
                tenants[name].key_hashes.append(key_digest(key))
            else:
                tenants[name] = Tenant(name, [key_digest(key)])
        owners: dict[bytes, str] = {}
        for tenant in tenants.values():
            for digest in tenant.key_hashes:
                # One key for two tenants would make its requests, limits and cache those of whichever matched
                # last. The message names the tenants, never the key.
                other = owners.setdefault(digest, tenant.name)
                if other != tenant.name:
                    raise ConfigError(f"tenants {other!r} and {tenant.name!r} have the same key: give each its own")
        return cls(list(tenants.values()))

    def acquire(self, tenant: Tenant | None, num_requests: int, num_tokens: int, *,
                requests_param: str = "prompt", tokens_param: str = "max_tokens",
                tokens_what: str = "prompt + max_tokens") -> Lease:
        """Take ``num_requests`` requests and ``num_tokens`` tokens from ``tenant``'s limits, all or nothing.
        The ``*_param`` arguments name the request's field a refusal blames, ``tokens_what`` what the tokens count.

        :raises RateLimited: a limit is reached; ``retry_after_s`` says when it will not be.
        :raises InvalidRequestError: the request is larger than a limit allows, so no wait would let it through.
        """
        if tenant is None:
            return Lease(None, num_requests, num_tokens)
        _check_fits(tenant, num_requests, num_tokens, requests_param, tokens_param, tokens_what)
        now = time.monotonic()
        with self._lock:
            if tenant.max_concurrency is not None and tenant._active + num_requests > tenant.max_concurrency:
                raise RateLimited(f"tenant {tenant.name!r} is at its limit of {tenant.max_concurrency} concurrent "
                                  "requests", 1.0, "concurrency")
            if tenant._requests is not None:
                wait = tenant._requests.wait_for(num_requests, now)
                if wait > 0:
                    raise RateLimited(f"tenant {tenant.name!r} is over its limit of {tenant.requests_per_second:g} "
                                      "requests per second", wait, "requests_per_second")
            if tenant._tokens is not None:
                wait = tenant._tokens.wait_for(num_tokens, now)
                if wait > 0:
                    raise RateLimited(f"tenant {tenant.name!r} is over its limit of {tenant.tokens_per_minute} "
                                      "tokens per minute", wait, "tokens_per_minute")
                tenant._tokens.take(num_tokens)
            if tenant._requests is not None:
                tenant._requests.take(num_requests)
            tenant._active += num_requests
        return Lease(tenant, num_requests, num_tokens)

    def take(self, tenant: Tenant | None, num_requests: int, num_tokens: int) -> Lease:
        """Like :meth:`acquire`, but never refused: for requests admitted before a restart, which go on whatever
        the limits say now and count towards them, so that new requests wait while they run."""
        if tenant is not None:
            with self._lock:
                tenant._active += num_requests
                if tenant._tokens is not None:
                    tenant._tokens.take(num_tokens)
        return Lease(tenant, num_requests, num_tokens)

    def release(self, lease: Lease, used_tokens: int) -> None:
        """End a lease: the concurrency slots, and the reserved tokens the requests did not use."""
        if lease.released:
            return
        lease.released = True
        tenant = lease.tenant
        if tenant is None:
            return
        with self._lock:
            tenant._active -= lease.num_requests
            unused = lease.reserved_tokens - used_tokens
            if tenant._tokens is not None and unused > 0:
                tenant._tokens.give_back(unused, time.monotonic())


def _check_fits(tenant: Tenant, num_requests: int, num_tokens: int, requests_param: str, tokens_param: str,
                tokens_what: str) -> None:
    """Refuse, as invalid (400), a request no wait would let through: a 429 would have clients retry it for ever.
    Checked before any limit that is only full for now, whose 429 would hide this."""
    if tenant.max_concurrency is not None and num_requests > tenant.max_concurrency:
        raise InvalidRequestError(f"request runs {num_requests} sequences (prompts x n), more than tenant "
                                  f"{tenant.name!r}'s limit of {tenant.max_concurrency} concurrent requests",
                                  param=requests_param)
    if tenant._requests is not None and num_requests > tenant._requests.capacity:
        raise InvalidRequestError(f"request runs {num_requests} sequences (prompts x n), more than tenant "
                                  f"{tenant.name!r}'s burst of {tenant._requests.capacity:g} requests",
                                  param=requests_param)
    if tenant._tokens is not None and num_tokens > tenant._tokens.capacity:
        raise InvalidRequestError(f"request needs {num_tokens} tokens ({tokens_what}), more than tenant "
                                  f"{tenant.name!r}'s limit of {tenant.tokens_per_minute} tokens per minute",
                                  param=tokens_param)


def cache_salt(tenant: Tenant | None, salt: str | None) -> str | None:
    """The prefix-cache salt of a request: its tenant's name and its own salt, so no two tenants (and no two
    salts) ever share cached blocks, while requests of one tenant with the same salt do."""
    if tenant is None and not salt:
        return None
    return json.dumps([tenant.name if tenant is not None else None, salt or None])


def _tenant_from_table(name: str, values: Any, environ: Mapping[str, str]) -> Tenant:
    where = f"[tenants.{name}]"
    if not _TENANT_NAME.match(name):
        raise ConfigError(f"tenant name {name!r} must be 1-64 letters, digits, '_', '.', '-'")
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where} must be a table")
    known = {"key_sha256", "key_env", "lanes", "default_lane", "requests_per_second", "burst",
             "tokens_per_minute", "max_concurrency"}
    unknown = set(values) - known
    if unknown:
        key = sorted(unknown)[0]
        hint = " (keys are never written in clear: use key_sha256 or key_env)" if key in ("key", "api_key") else ""
        raise ConfigError(f"unknown setting {key!r} in {where}{hint}")
    hashes = []
    for digest in _as_list(values.get("key_sha256"), f"{where} key_sha256"):
        if not isinstance(digest, str) or not _SHA256_HEX.match(digest.lower()):
            raise ConfigError(f"{where} key_sha256 must hold 64-character hex SHA-256 digests")
        hashes.append(bytes.fromhex(digest))
    for var in _as_list(values.get("key_env"), f"{where} key_env"):
        key = environ.get(var)
        if not key:
            raise ConfigError(f"{where} key_env names {var!r}, which is not set")
        hashes.append(key_digest(key))
    lanes = tuple(_as_list(values.get("lanes", list(LANE_NAMES)), f"{where} lanes"))
    if not lanes:
        raise ConfigError(f"{where} lanes is empty: a tenant needs at least one lane (lanes are: "
                          f"{', '.join(LANE_NAMES)})")
    for lane in lanes:
        if lane not in LANE_NAMES:
            raise ConfigError(f"{where} lanes: unknown lane {lane!r} (lanes are: {', '.join(LANE_NAMES)})")
    default_lane = values.get("default_lane", DEFAULT_LANE if DEFAULT_LANE in lanes else lanes[-1])
    if default_lane not in lanes:
        raise ConfigError(f"{where} default_lane {default_lane!r} is not among its lanes")
    def limit(setting: str, integer: bool) -> Any:
        """The setting, None where not given. Counts (requests, tokens) are integers: TOML tells 2 from 2.0, and
        a bool is a number only to Python."""
        value = values.get(setting)
        if value is None:
            return None
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value < math.inf:
            raise ConfigError(f"{where} {setting} must be a positive {'integer' if integer else 'number'}, "
                              f"got {value!r}")
        return value

    if "burst" in values and "requests_per_second" not in values:
        raise ConfigError(f"{where} burst needs requests_per_second (it is the depth of that rate's bucket)")
    return Tenant(name, hashes, lanes, default_lane, requests_per_second=limit("requests_per_second", False),
                  burst=limit("burst", True), tokens_per_minute=limit("tokens_per_minute", True),
                  max_concurrency=limit("max_concurrency", True))


def _env_keys(value: str) -> list[tuple[str, str]]:
    pairs = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, key = item.partition("=")
        if not sep or not key or not _TENANT_NAME.match(name):
            # The message must not echo the item: it holds a key.
            raise ConfigError(f"{KEYS_ENV} must be a comma-separated list of tenant=key pairs")
        pairs.append((name, key))
    return pairs


def _as_list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        return [value]
    raise ConfigError(f"{where} must be a string or a list of strings")
