"""Authenticator contract: which tenant sent a request, from the credentials it presented.

The server asks its authenticators in the order ``[auth] authenticators`` lists them (``docs/serving.md``). Each
looks at a request's :class:`Credentials` and answers in one of three ways:

- a tenant's name: the credentials are of its kind and prove that tenant;
- ``None``: they are not of its kind (no bearer token for a JWT verifier, no client certificate for mTLS, a key it
  does not hold): the next authenticator is asked;
- :class:`AuthenticationFailed`: they are of its kind and prove nothing (a bad signature, an expired token).

Every refusal, and credentials no authenticator accepts, become the same answer (HTTP 401 with ``WWW-Authenticate``,
gRPC UNAUTHENTICATED), so a caller never learns which part was wrong; the reason goes to the server's log alone and
must never hold the secret. A tenant name the server does not know is refused the same way.

Authenticators run on the servers' event loop, once per request: ``authenticate`` must not block (no network calls;
read key files when built).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar


def key_digest(key: str) -> bytes:
    """The SHA-256 digest under which API keys are held (:attr:`AuthenticatorContext.tenants`)."""
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a request presented. Header values are as sent; nothing here was checked yet, except the certificate."""

    # The ``Authorization`` header (gRPC: ``authorization`` metadata).
    authorization: str | None = None
    # The ``x-api-key`` header (or metadata), the other place clients send API keys.
    api_key: str | None = None
    # The subject of the client's TLS certificate, verified by the server against its CA (mTLS), by RFC 4514
    # attribute name (``CN``, ``O``, ``OU``...); None without one.
    client_cert_subject: Mapping[str, str] | None = None
    # The source address (an IP address), for the log.
    peer: str | None = None

    def bearer(self) -> str | None:
        """The token of ``Authorization: Bearer <token>``; None for another scheme or an empty token."""
        if not self.authorization:
            return None
        scheme, _, token = self.authorization.strip().partition(" ")
        token = token.strip()
        return token if scheme.lower() == "bearer" and token else None

    def presented_secret(self) -> str | None:
        """The bearer token, else the ``x-api-key`` value: what an API key or a token authenticator reads."""
        return self.bearer() or self.api_key or None


@dataclass(slots=True)
class AuthenticatorContext:
    # The tenants the server knows, each with the digests (key_digest) of its API keys (empty for a tenant that proves
    # itself another way). A name returned by ``authenticate`` must be one of these.
    tenants: Mapping[str, Sequence[bytes]]
    # The authenticator's own settings: the ``[auth.<name>]`` table of the serving config, empty by default.
    options: dict[str, Any] = field(default_factory=dict)


class AuthenticationFailed(Exception):
    """Credentials of this authenticator's kind that prove no tenant. ``reason`` is for the server's log: say what
    was wrong (``"token expired"``), never the credentials themselves."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class AuthenticatorExample:
    """What ``rtx plugins test`` builds an authenticator with and presents to it."""

    context: AuthenticatorContext
    # Credentials it must accept, each with the tenant they prove.
    accepted: list[tuple[Credentials, str]]
    # Credentials of its kind it must refuse (None or AuthenticationFailed, never a tenant).
    refused: list[Credentials] = field(default_factory=list)


class Authenticator(ABC):
    """Built as ``cls(context)``, once per server; ``authenticate`` may run for many requests at once."""

    # The scheme of the ``WWW-Authenticate`` challenge a refused HTTP request gets, when this authenticator is
    # configured: ``"Bearer"`` for one that reads bearer tokens; None for one that asks nothing of the request
    # (a client certificate is asked for by TLS itself).
    scheme: ClassVar[str | None] = "Bearer"

    def __init__(self, context: AuthenticatorContext):
        self.context = context

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """What ``rtx plugins list --verbose`` shows (its settings, say)."""
        return {}

    @classmethod
    @abstractmethod
    def example(cls) -> AuthenticatorExample:
        """A context to build it with and credentials it accepts and refuses, for the conformance suite; may create
        keys in memory, never touch the network."""

    @abstractmethod
    def authenticate(self, credentials: Credentials) -> str | None:
        """The tenant ``credentials`` prove; None when they are not of this authenticator's kind.

        :raises AuthenticationFailed: they are of its kind and prove nothing; the reason is logged, never sent.
        """
