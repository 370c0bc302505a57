"""TLS for the HTTP server, and the client certificate it verified handed to the app.

uvicorn terminates TLS but does not fill in the ASGI TLS extension (``scope["extensions"]["tls"]``), which is where an
ASGI app finds the client's certificate. :func:`peer_certificate_protocol` is uvicorn's HTTP protocol with it added
for connections whose client presented a certificate; the handshake has verified it against the CA by then (a client
certificate is only asked for when ``--ssl-cert-reqs required``).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

from rtxcore.server.serving.authentication import certificate_subject
from rtxcore.server.serving.settings import TlsSettings


def uvicorn_tls_options(tls: TlsSettings | None) -> dict[str, Any]:
    """The keyword arguments of ``uvicorn.Config`` that serve ``tls``; none for plain text."""
    if tls is None:
        return {}
    return {"ssl_certfile": tls.certfile, "ssl_keyfile": tls.keyfile, "ssl_ca_certs": tls.ca_certs,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.cert_reqs == "required" else ssl.CERT_NONE,
            "http": peer_certificate_protocol()}


def peer_certificate_protocol() -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class PeerCertificateProtocol(AutoHTTPProtocol):  # type: ignore[valid-type,misc]
        """uvicorn's protocol (httptools or h11, whichever it picks) whose app sees the client's certificate."""

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            ssl_object = transport.get_extra_info("ssl_object")
            der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
            if der:
                # The subject is read once a connection, not on each of its requests (rtx_client_cert_subject is
                # ours; the others are the ASGI TLS extension's keys).
                extension = {"client_cert_chain": [ssl.DER_cert_to_PEM_cert(der)], "client_cert_error": None,
                             "tls_version": ssl_object.version(), "cipher_suite": (ssl_object.cipher() or (None,))[0],
                             "rtx_client_cert_subject": certificate_subject(der)}
                self.app = _with_tls_extension(self.app, extension)  # type: ignore[has-type]

    return PeerCertificateProtocol


def _with_tls_extension(app: Any, extension: dict[str, Any]) -> Any:
    async def with_tls(scope: dict, receive: Any, send: Any) -> None:
        scope["extensions"] = {**(scope.get("extensions") or {}), "tls": extension}
        await app(scope, receive, send)

    return with_tls

