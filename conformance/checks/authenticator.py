"""The authenticator contract, checked with the credentials the plugin declares (``example()``) and with junk no
authenticator may take for a tenant: empty and malformed headers, other schemes, random and oversized tokens, JWT-shaped
garbage, certificates of unknown tenants."""

from __future__ import annotations

import random
import string
from collections.abc import Iterator

from rtx_conformance.rules import ContractViolation, build, describe_exception, require
from rtxcore.contracts.authenticator import (
    AuthenticationFailed,
    Authenticator,
    AuthenticatorExample,
    Credentials,
)


def example_of(cls: type[Authenticator]) -> AuthenticatorExample:
    try:
        example = cls.example()
    except Exception as exc:
        raise ContractViolation("authenticator.example", f"example() raised {describe_exception(exc, cls)}") from exc
    require(isinstance(example, AuthenticatorExample), "authenticator.example",
            f"example() returned {type(example).__name__}, not an AuthenticatorExample")
    require(bool(example.accepted), "authenticator.example", "example() lists no credentials it accepts")
    for credentials, tenant in example.accepted:
        require(isinstance(credentials, Credentials) and tenant in example.context.tenants, "authenticator.example",
                f"an accepted example proves {tenant!r}, which is not among its context's tenants")
    return example


def build_from(cls: type[Authenticator], example: AuthenticatorExample) -> Authenticator:
    return build("authenticator", cls, example.context)


def answer(authenticator: Authenticator, credentials: Credentials) -> tuple[str | None, AuthenticationFailed | None]:
    """(tenant or None, the refusal or None); anything else it raises or returns breaks authenticator.api."""
    try:
        found = authenticator.authenticate(credentials)
    except AuthenticationFailed as exc:
        require(isinstance(exc.reason, str) and bool(exc.reason), "authenticator.api",
                "AuthenticationFailed raised without a reason for the log")
        return None, exc
    except Exception as exc:
        raise ContractViolation("authenticator.api", f"authenticate({_shown(credentials)}) raised "
                                f"{describe_exception(exc, type(authenticator))}") from exc
    require(found is None or isinstance(found, str), "authenticator.api",
            f"authenticate() returned {type(found).__name__}, not a tenant name or None")
    return found, None


def check_accepts(authenticator: Authenticator, example: AuthenticatorExample) -> int:
    for credentials, tenant in example.accepted:
        found, refusal = answer(authenticator, credentials)
        require(found == tenant, "authenticator.accepts",
                f"{_shown(credentials)} proves {found!r}, expected {tenant!r}"
                + (f" (refused: {refusal.reason})" if refusal is not None else ""))
    return len(example.accepted)


def check_refuses(authenticator: Authenticator, example: AuthenticatorExample, seed: int = 0) -> int:
    """The example's refused credentials and generated junk prove no tenant; no refusal's reason repeats a secret."""
    count = 0
    for credentials in [*example.refused, *junk(example, seed)]:
        found, refusal = answer(authenticator, credentials)
        require(found is None, "authenticator.refuses", f"{_shown(credentials)} was taken for tenant {found!r}")
        if refusal is not None:
            for secret in _secrets(credentials):
                require(secret not in refusal.reason, "authenticator.reason_without_secret",
                        f"the refusal of {_shown(credentials)} repeats what was presented: {refusal.reason[:80]!r}")
        count += 1
    return count


def check_nothing_presented(authenticator: Authenticator) -> None:
    found, refusal = answer(authenticator, Credentials(peer="127.0.0.1"))
    require(found is None and refusal is None, "authenticator.nothing_presented",
            f"with nothing presented it answered {found!r}" if found is not None
            else f"with nothing presented it refused ({refusal.reason if refusal else ''}) instead of returning None")


def junk(example: AuthenticatorExample, seed: int) -> Iterator[Credentials]:
    rng = random.Random(seed)
    accepted = [c for c, _ in example.accepted]
    tokens = [c.presented_secret() for c in accepted if c.presented_secret()]
    for header in ("", " ", "Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "Bearer a.b", "Bearer ...", "Bearer a.b.c.d",
                   "Bearer e30.e30.", "Bearer \u00e9\u00e8.\u00ea.\u00eb", "Bearer " + "A" * 65536, "Token abc"):
        yield Credentials(authorization=header, peer="127.0.0.1")
    for _ in range(20):
        text = "".join(rng.choice(string.ascii_letters + string.digits + "-_.~+/=") for _ in range(rng.randint(1, 300)))
        yield Credentials(authorization="Bearer " + text)
        yield Credentials(api_key=text)
    for token in tokens:
        assert token is not None
        # One character changed, the token cut short, doubled: none is the accepted token.
        index = rng.randrange(len(token))
        flipped = token[:index] + ("A" if token[index] != "A" else "B") + token[index + 1:]
        for variant in (flipped, token[:-1], token + token, token.upper() if token.upper() != token else token + "x"):
            if variant != token:
                yield Credentials(authorization="Bearer " + variant)
    for subject in ({}, {"CN": ""}, {"CN": "no-such-tenant-" + str(seed)}, {"O": "\x00"}):
        yield Credentials(client_cert_subject=subject)


def _secrets(credentials: Credentials) -> list[str]:
    """What a refusal must not repeat: the presented token or key (its parts too, for a JWT), long enough to matter."""
    values = [credentials.presented_secret() or ""]
    values += [part for value in list(values) for part in value.split(".")]
    return [value for value in values if len(value) >= 12]


def _shown(credentials: Credentials) -> str:
    fields = []
    if credentials.authorization is not None:
        fields.append(f"authorization={credentials.authorization[:40]!r}"
                      + ("..." if len(credentials.authorization) > 40 else ""))
    if credentials.api_key is not None:
        fields.append(f"api_key={credentials.api_key[:24]!r}")
    if credentials.client_cert_subject is not None:
        fields.append(f"client_cert_subject={dict(credentials.client_cert_subject)!r}")
    return "Credentials(" + ", ".join(fields) + ")"
