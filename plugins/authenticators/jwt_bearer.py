"""The ``jwt`` authenticator: a JSON Web Token sent as ``Authorization: Bearer <token>``, signed by an identity
provider whose public keys the server holds (a JWKS file, or one PEM public key), naming its tenant in a claim.

Settings (``[auth.jwt]`` in the serving config)::

    jwks_file = "/etc/rtx/jwks.json"   # or public_key_file = "issuer.pem" (or public_key = "-----BEGIN ...")
    issuer = "https://login.example.com/"      # checked when set (the "iss" claim)
    audience = "rtx"                            # checked when set (the "aud" claim)
    tenant_claim = "tenant"                     # the claim holding the tenant's name; dots reach into objects
    algorithms = ["RS256", "ES256"]             # default: every asymmetric algorithm PyJWT knows
    leeway_s = 0                                # clock skew allowed on "exp" and "nbf"

Only asymmetric algorithms are accepted: with a shared secret (HS256) whoever can verify a token can also mint one
for any tenant, and "none" proves nothing. Tokens must carry "exp". Verification is PyJWT's (signature, expiry,
not-before, issuer, audience); this module picks the key and maps the claim to a tenant.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from rtxcore.contracts.authenticator import (
    AuthenticationFailed,
    Authenticator,
    AuthenticatorContext,
    AuthenticatorExample,
    Credentials,
)
from rtxcore.errors import ConfigError
from rtxcore.hookspecs import hookimpl

ASYMMETRIC = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
_SETTINGS = ("jwks_file", "public_key_file", "public_key", "issuer", "audience", "tenant_claim", "algorithms",
             "leeway_s")


class JwtAuthenticator(Authenticator):
    def __init__(self, context: AuthenticatorContext):
        super().__init__(context)
        options = context.options
        unknown = sorted(set(options) - set(_SETTINGS))
        if unknown:
            raise ConfigError(f"unknown setting {unknown[0]!r} in [auth.jwt] (settings: {', '.join(_SETTINGS)})")
        self.algorithms = _algorithms(options.get("algorithms", list(ASYMMETRIC)))
        # kid -> key; the key under None is used for tokens without a kid when it is the only one.
        self.keys = _load_keys(options)
        self.issuer: str | None = _optional_str(options, "issuer")
        audience = options.get("audience")
        if audience is not None and not (isinstance(audience, str) or _strings(audience)):
            raise ConfigError("[auth.jwt] audience must be a string or a list of strings")
        self.audience: str | list[str] | None = audience
        self.tenant_claim: str = _optional_str(options, "tenant_claim") or "tenant"
        leeway = options.get("leeway_s", 0)
        if isinstance(leeway, bool) or not isinstance(leeway, (int, float)) or leeway < 0:
            raise ConfigError(f"[auth.jwt] leeway_s must be a number of seconds >= 0, got {leeway!r}")
        self.leeway_s = float(leeway)

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"description": "JWT bearer tokens verified against a JWKS file or a public key",
                "settings": list(_SETTINGS)}

    @classmethod
    def example(cls) -> AuthenticatorExample:
        issuer_key = ec.generate_private_key(ec.SECP256R1())
        other_key = ec.generate_private_key(ec.SECP256R1())
        public_pem = issuer_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
        now = int(time.time())
        claims = {"iss": "https://idp.example", "aud": "rtx", "exp": now + 600, "tenant": "acme"}

        def bearer(key: Any, **changes: Any) -> Credentials:
            return Credentials(authorization="Bearer " + jwt.encode({**claims, **changes}, key, algorithm="ES256"))

        context = AuthenticatorContext({"acme": [], "globex": []},
                                       {"public_key": public_pem, "issuer": "https://idp.example", "audience": "rtx"})
        return AuthenticatorExample(
            context,
            accepted=[(bearer(issuer_key), "acme"), (bearer(issuer_key, tenant="globex"), "globex")],
            refused=[bearer(other_key), bearer(issuer_key, exp=now - 60), bearer(issuer_key, tenant="initech"),
                     bearer(issuer_key, iss="https://evil.example"), bearer(issuer_key, aud="other"),
                     Credentials(authorization="Bearer e30.e30.c2ln"), Credentials(authorization="Bearer a.b.c")])

    def authenticate(self, credentials: Credentials) -> str | None:
        token = credentials.bearer()
        if token is None or token.count(".") != 2:
            return None  # not a JWT (an API key, another scheme): another authenticator's
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:
            raise AuthenticationFailed("malformed token header") from None
        key = self._key_for(header.get("kid"))
        required = ["exp", *(["iss"] if self.issuer else []), *(["aud"] if self.audience else [])]
        try:
            claims = jwt.decode(token, key, algorithms=self.algorithms, audience=self.audience, issuer=self.issuer,
                                leeway=self.leeway_s, options={"require": required})
        except jwt.ExpiredSignatureError:
            raise AuthenticationFailed("token expired") from None
        except jwt.InvalidSignatureError:
            raise AuthenticationFailed("signature does not verify") from None
        except jwt.InvalidTokenError as exc:
            # PyJWT's messages name the claim or the algorithm at fault, never the token.
            raise AuthenticationFailed(f"invalid token: {exc}") from None
        tenant = _claim(claims, self.tenant_claim)
        if not isinstance(tenant, str) or not tenant:
            raise AuthenticationFailed(f"token has no {self.tenant_claim!r} claim naming a tenant")
        if tenant not in self.context.tenants:
            raise AuthenticationFailed(f"token names an unknown tenant {tenant[:64]!r}")
        return tenant

    def _key_for(self, kid: object) -> Any:
        if isinstance(kid, str) and kid in self.keys:
            return self.keys[kid]
        if kid is None and len(self.keys) == 1:
            return next(iter(self.keys.values()))
        raise AuthenticationFailed("token's key id is not among the issuer's keys" if kid is not None
                                   else "token has no key id and the issuer has several keys")


def _load_keys(options: dict[str, Any]) -> dict[str | None, Any]:
    given = [name for name in ("jwks_file", "public_key_file", "public_key") if options.get(name)]
    if len(given) != 1:
        raise ConfigError("[auth.jwt] needs exactly one of jwks_file, public_key_file, public_key")
    source = given[0]
    if source == "jwks_file":
        text = _read(options["jwks_file"], "jwks_file")
        try:
            keys = jwt.PyJWKSet.from_dict(json.loads(text)).keys
        except (ValueError, jwt.PyJWTError) as exc:
            raise ConfigError(f"[auth.jwt] jwks_file {options['jwks_file']!r} is not a usable JWKS: {exc}") from None
        return {key.key_id: key.key for key in keys}
    pem = options["public_key"] if source == "public_key" else _read(options["public_key_file"], "public_key_file")
    try:
        return {None: serialization.load_pem_public_key(str(pem).encode())}
    except ValueError:
        raise ConfigError(f"[auth.jwt] {source} is not a PEM public key") from None


def _read(path: object, setting: str) -> str:
    try:
        return Path(str(path)).read_text()
    except OSError as exc:
        raise ConfigError(f"[auth.jwt] {setting} {str(path)!r} cannot be read: {exc.strerror}") from None


def _algorithms(value: object) -> list[str]:
    if not _strings(value) or not value:
        raise ConfigError("[auth.jwt] algorithms must be a non-empty list of names")
    assert isinstance(value, list)
    for name in value:
        if name not in ASYMMETRIC:
            raise ConfigError(f"[auth.jwt] algorithm {name!r} is not accepted (asymmetric ones only: "
                              f"{', '.join(ASYMMETRIC)})")
    return list(value)


def _optional_str(options: dict[str, Any], name: str) -> str | None:
    value = options.get(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"[auth.jwt] {name} must be a non-empty string")
    return value


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _claim(claims: dict[str, Any], path: str) -> object:
    value: object = claims
    for part in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


@hookimpl
def register_authenticators(register) -> None:
    register("jwt", JwtAuthenticator)
