"""The ``mtls`` authenticator: the tenant is an attribute of the client's TLS certificate subject, the certificate
verified by the server against its CA during the handshake (``rtx serve --ssl-ca-certs CA.pem --ssl-cert-reqs
required``, HTTP and gRPC alike).

Settings (``[auth.mtls]``)::

    tenant_attribute = "CN"     # the subject attribute naming the tenant (RFC 4514 name: CN, O, OU, ...)
"""

from __future__ import annotations

from typing import Any

from rtxcore.contracts.authenticator import (
    AuthenticationFailed,
    Authenticator,
    AuthenticatorContext,
    AuthenticatorExample,
    Credentials,
)
from rtxcore.errors import ConfigError
from rtxcore.hookspecs import hookimpl


class MtlsAuthenticator(Authenticator):
    # The certificate is asked for by the TLS handshake, not by an HTTP challenge.
    scheme = None

    def __init__(self, context: AuthenticatorContext):
        super().__init__(context)
        unknown = sorted(set(context.options) - {"tenant_attribute"})
        if unknown:
            raise ConfigError(f"unknown setting {unknown[0]!r} in [auth.mtls] (settings: tenant_attribute)")
        attribute = context.options.get("tenant_attribute", "CN")
        if not isinstance(attribute, str) or not attribute:
            raise ConfigError("[auth.mtls] tenant_attribute must be an attribute name such as CN or O")
        self.attribute = attribute

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"description": "TLS client certificates verified against the server's CA; the tenant is a subject "
                               "attribute (CN by default)"}

    @classmethod
    def example(cls) -> AuthenticatorExample:
        return AuthenticatorExample(
            AuthenticatorContext({"acme": [], "globex": []}, {"tenant_attribute": "O"}),
            accepted=[(Credentials(client_cert_subject={"CN": "worker-1", "O": "acme"}), "acme")],
            refused=[Credentials(client_cert_subject={"CN": "acme"}),
                     Credentials(client_cert_subject={"CN": "x", "O": "initech"})])

    def authenticate(self, credentials: Credentials) -> str | None:
        subject = credentials.client_cert_subject
        if subject is None:
            return None
        tenant = subject.get(self.attribute)
        if not tenant:
            raise AuthenticationFailed(f"client certificate subject has no {self.attribute}")
        if tenant not in self.context.tenants:
            raise AuthenticationFailed(f"client certificate names an unknown tenant {tenant[:64]!r}")
        return tenant


@hookimpl
def register_authenticators(register) -> None:
    register("mtls", MtlsAuthenticator)
