"""The ``api-key`` authenticator: an API key, sent as ``Authorization: Bearer <key>`` or ``x-api-key``, that one
tenant of the serving config holds (``key_sha256``, ``key_env``, ``RTX_API_KEYS`` or ``rtx serve --api-key``).

Keys are held only as SHA-256 digests. A presented key is hashed and compared with every stored digest in constant
time (``hmac.compare_digest``, no early exit), so timing says nothing about which key or how much of one matched.
"""

from __future__ import annotations

import hmac
from typing import Any

from rtxcore.contracts.authenticator import (
    Authenticator,
    AuthenticatorContext,
    AuthenticatorExample,
    Credentials,
    key_digest,
)
from rtxcore.hookspecs import hookimpl


class ApiKeyAuthenticator(Authenticator):
    def __init__(self, context: AuthenticatorContext):
        super().__init__(context)
        self._digests = [(digest, tenant) for tenant, digests in context.tenants.items() for digest in digests]

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"description": "API keys of the configured tenants (Authorization: Bearer, or x-api-key)"}

    @classmethod
    def example(cls) -> AuthenticatorExample:
        tenants = {"acme": [key_digest("sk-acme-1"), key_digest("sk-acme-2")], "globex": [key_digest("sk-globex")]}
        return AuthenticatorExample(
            AuthenticatorContext(tenants),
            accepted=[(Credentials(authorization="Bearer sk-acme-2"), "acme"),
                      (Credentials(api_key="sk-globex"), "globex")],
            refused=[Credentials(authorization="Bearer sk-acme-3"), Credentials(api_key="sk-acme"),
                     Credentials(authorization="Basic sk-acme-1")])

    def authenticate(self, credentials: Credentials) -> str | None:
        presented = credentials.presented_secret()
        if presented is None:
            return None
        digest = key_digest(presented)
        found = None
        for stored, tenant in self._digests:  # every digest is compared, whichever matches
            if hmac.compare_digest(digest, stored):
                found = tenant
        # A key no tenant holds may be another authenticator's token: None lets the next one look.
        return found


@hookimpl
def register_authenticators(register) -> None:
    register("api-key", ApiKeyAuthenticator)
