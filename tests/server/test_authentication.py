"""Pluggable authentication: API keys and JWT bearer tokens side by side, mutual TLS on HTTP and gRPC, every refusal
the same 401 (UNAUTHENTICATED) logged with its reason and never the token, failures limited per source address."""

from __future__ import annotations

import json
import logging
import ssl
import time

import grpc
import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from rtxcore.contracts.authenticator import AuthenticationFailed, Authenticator, Credentials
from rtxcore.errors import ConfigError
from rtxcore.registry import load_plugins
from rtxcore.server.serving.authentication import Authentication, AuthError, AuthSettings, TooManyFailures
from rtxcore.server.serving.tenants import TenantRegistry
from tests.helpers.certs import TestCA
from tests.helpers.server import ServerProcess, start_server
from tests.server.test_tenants import sha

ISSUER = "https://idp.test"
KEY_ACME = "sk-acme-" + "3c1f9e0d7b5a4c2e8f6a1b3d5e7f9a0c"


class Tokens:
    """An identity provider: its signing key, and tokens signed by it (or by someone else)."""

    def __init__(self):
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.public_pem = self.key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()

    def token(self, key=None, **claims) -> str:
        body = {"iss": ISSUER, "aud": "rtx", "exp": int(time.time()) + 600, "tenant": "globex", **claims}
        return jwt.encode(body, key or self.key, algorithm="ES256")


@pytest.fixture(scope="module")
def tokens() -> Tokens:
    return Tokens()


def refused_tokens(tokens: Tokens) -> dict[str, tuple[str, str]]:
    """The bar's cases: name -> (Authorization header, the reason the log gives)."""
    good = tokens.token()
    header, payload, signature = good.split(".")
    return {
        "wrong signature": ("Bearer " + tokens.token(key=ec.generate_private_key(ec.SECP256R1())),
                            "jwt: signature does not verify"),
        "expired": ("Bearer " + tokens.token(exp=int(time.time()) - 30), "jwt: token expired"),
        "unknown tenant": ("Bearer " + tokens.token(tenant="initech"), "jwt: token names an unknown tenant 'initech'"),
        "malformed token header": (f"Bearer {header[:-3]}!{header[-2:]}.{payload}.{signature}",
                                   "jwt: malformed token header"),
        "no token after the scheme": ("Bearer", "no authenticator accepts the credentials"),
        "another scheme": ("Basic " + good, "no authenticator accepts the credentials"),
    }


def auth_for(tokens: Tokens, **auth_table) -> Authentication:
    tenants = TenantRegistry.from_config({"acme": {"key_sha256": sha(KEY_ACME)}, "globex": {}}, environ={})
    table = {"authenticators": ["api-key", "jwt"], "jwt": {"public_key": tokens.public_pem, "issuer": ISSUER,
                                                            "audience": "rtx"}, **auth_table}
    return Authentication.from_config(AuthSettings.from_table(table), tenants)


# -- the authenticators, in process ---------------------------------------------------------------------------------


def test_keys_and_tokens_prove_their_tenants_and_refusals_say_nothing_to_the_caller(tokens, caplog):
    auth = auth_for(tokens)
    assert auth.challenge == "Bearer"
    assert auth.authenticate(Credentials(authorization=f"Bearer {KEY_ACME}")).name == "acme"
    assert auth.authenticate(Credentials(authorization="Bearer " + tokens.token())).name == "globex"
    caplog.set_level(logging.WARNING, "rtx.server.auth")
    for name, (header, reason) in refused_tokens(tokens).items():
        caplog.clear()
        with pytest.raises(AuthError) as refused:
            auth.authenticate(Credentials(authorization=header, peer="10.0.0.7"))
        assert refused.value.message == "invalid credentials", name
        assert caplog.messages == [f"authentication failed from 10.0.0.7: {reason}"], name
        token = header.partition(" ")[2]
        for part in [token, *token.split(".")]:
            assert len(part) < 12 or part not in caplog.text, name
    with pytest.raises(AuthError, match="missing credentials"):
        auth.authenticate(Credentials())


def test_jwks_keys_are_chosen_by_kid_and_the_tenant_claim_can_be_nested(tmp_path, caplog):
    from cryptography.hazmat.primitives.asymmetric import rsa

    keys = {kid: rsa.generate_private_key(public_exponent=65537, key_size=2048) for kid in ("k1", "k2")}
    jwks = {"keys": [{**jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key(), as_dict=True), "kid": kid,
                      "use": "sig", "alg": "RS256"} for kid, key in keys.items()]}
    (tmp_path / "jwks.json").write_text(json.dumps(jwks))
    tenants = TenantRegistry.from_config({"acme": {}}, environ={})
    auth = Authentication.from_config(AuthSettings.from_table(
        {"authenticators": ["jwt"], "jwt": {"jwks_file": str(tmp_path / "jwks.json"), "tenant_claim": "org.id",
                                            "algorithms": ["RS256"]}}), tenants)

    def bearer(kid, key, **claims):
        body = {"exp": int(time.time()) + 60, "org": {"id": "acme"}, **claims}
        headers = {"kid": kid} if kid is not None else {}
        return Credentials(authorization="Bearer " + jwt.encode(body, key, algorithm="RS256", headers=headers))

    assert auth.authenticate(bearer("k2", keys["k2"])).name == "acme"
    caplog.set_level(logging.WARNING, "rtx.server.auth")
    for credentials, reason in [(bearer("k1", keys["k2"]), "jwt: signature does not verify"),
                                (bearer("k9", keys["k1"]), "jwt: token's key id is not among the issuer's keys"),
                                (bearer(None, keys["k1"]), "jwt: token has no key id and the issuer has several keys"),
                                (bearer("k1", keys["k1"], org={"name": "acme"}),
                                 "jwt: token has no 'org.id' claim naming a tenant"),
                                (bearer("k1", keys["k1"], exp=None), "jwt: invalid token")]:
        caplog.clear()
        with pytest.raises(AuthError):
            auth.authenticate(credentials)
        assert caplog.messages[0].startswith(f"authentication failed from unknown: {reason}"), caplog.messages


def test_failures_are_limited_per_source_address(tokens, monkeypatch):
    auth = auth_for(tokens, failures_per_minute=60, failure_burst=3)
    now = [1000.0]
    monkeypatch.setattr("rtxcore.server.serving.authentication.time.monotonic", lambda: now[0])
    bad = Credentials(authorization="Bearer sk-guess", peer="10.0.0.1")
    for _ in range(3):
        with pytest.raises(AuthError):
            auth.authenticate(bad)
    # The address is refused before anything is checked, good credentials included, and says when to come back.
    good = Credentials(authorization=f"Bearer {KEY_ACME}", peer="10.0.0.1")
    with pytest.raises(TooManyFailures) as limited:
        auth.authenticate(good)
    assert limited.value.retry_after_s == 1.0
    # Another address is not affected.
    assert auth.authenticate(Credentials(authorization=f"Bearer {KEY_ACME}", peer="10.0.0.2")).name == "acme"
    now[0] += 1.0  # one failure's worth refilled (60 a minute)
    assert auth.authenticate(good).name == "acme"


def test_a_plugin_that_raises_refuses_without_quoting_its_error(tokens, caplog):
    class Broken(Authenticator):
        @classmethod
        def example(cls):
            raise NotImplementedError

        def authenticate(self, credentials):
            raise ValueError(f"cannot parse {credentials.authorization}")

    class Rejecting(Broken):
        def authenticate(self, credentials):
            raise AuthenticationFailed("revoked")

    tenants = TenantRegistry.from_config({"acme": {}}, environ={})
    auth = Authentication([("broken", Broken(None)), ("rejecting", Rejecting(None))], tenants)
    caplog.set_level(logging.WARNING, "rtx.server.auth")
    with pytest.raises(AuthError):
        auth.authenticate(Credentials(authorization="Bearer secret-token-123456"))
    # Failing closed: the first authenticator's error ends the chain, its message (holding the token) unlogged.
    assert caplog.messages == ["authentication failed from unknown: broken plugin failed: ValueError"]


@pytest.mark.parametrize("schemes, hint", [
    (["Bearer"], "send 'Authorization: Bearer <key or token>'"),
    (["Gateway"], "send credentials of the scheme Gateway"),
    (["Gateway", "Bearer"], "send credentials of the schemes Gateway, Bearer"),
    ([None], "present a client certificate"),
])
def test_missing_credentials_are_asked_for_in_the_configured_schemes(schemes, hint):
    def authenticator(scheme):
        class Header(Authenticator):
            @classmethod
            def example(cls):
                raise NotImplementedError

            def authenticate(self, credentials):
                return None

        Header.scheme = scheme
        return Header(None)

    auth = Authentication([(f"a{i}", authenticator(s)) for i, s in enumerate(schemes)],
                          TenantRegistry.from_config({"acme": {}}, environ={}))
    with pytest.raises(AuthError) as refused:
        auth.authenticate(Credentials())
    assert refused.value.message == f"missing credentials: {hint}"


@pytest.mark.parametrize("table, tenants, message", [
    ({"authenticators": ["jwt"]}, {}, "need tenants to prove"),
    ({"authenticators": []}, {"a": {"key_sha256": sha("k")}}, "authenticators is empty"),
    ({"authenticators": ["jwt"], "jwt": {"public_key": "x"}}, {"a": {"key_sha256": sha("k")}},
     "does not list api-key"),
    ({"authenticators": ["jwt"], "jwt": {"public_key": "not a key"}}, {"a": {}}, "public_key is not a PEM public key"),
    ({"authenticators": ["jwt"], "jwt": {"jwks_file": "/nonexistent.json"}}, {"a": {}}, "cannot be read"),
    ({"authenticators": ["jwt"], "jwt": {"public_key": "x", "algorithms": ["HS256"]}}, {"a": {}},
     "'HS256' is not accepted"),
    ({"authenticators": ["jwt"], "jwt": {"public_key": "x", "secret": "y"}}, {"a": {}}, "unknown setting 'secret'"),
    ({"authenticators": ["api-key"], "mtls": {}}, {"a": {"key_sha256": sha("k")}}, r"\[auth.mtls\] configures"),
    ({"authenticators": ["nope"]}, {"a": {}}, "no authenticator named 'nope'"),
    # A misspelt name is named first, not blamed on the tenants (it used to be "need tenants to prove").
    ({"authenticators": ["apikey"]}, {}, "no authenticator named 'apikey'"),
    ({"authenticators": ["apikey"]}, {"a": {"key_sha256": sha("k")}}, "no authenticator named 'apikey'"),
    ({"failure_burst": 0}, {}, "failure_burst must be a positive number"),
    ({"failure_burst": 0.5}, {}, "failure_burst must be a whole number"),
])
def test_auth_config_errors_name_the_problem(table, tenants, message):
    with pytest.raises(Exception, match=message) as exc:
        Authentication.from_config(AuthSettings.from_table(table), TenantRegistry.from_config(tenants, environ={}),
                                   load_plugins())
    assert isinstance(exc.value, ConfigError) or "no authenticator named" in message


# -- API keys and JWTs through a server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jwt_server(tmp_path_factory, tokens):
    folder = tmp_path_factory.mktemp("jwt")
    (folder / "issuer.pem").write_text(tokens.public_pem)
    config = folder / "serve.toml"
    config.write_text(f"""
[auth]
authenticators = ["api-key", "jwt"]
failure_burst = 20
failures_per_minute = 1

[auth.jwt]
public_key_file = "{folder / 'issuer.pem'}"
issuer = "{ISSUER}"
audience = "rtx"

[tenants.acme]
key_sha256 = "{sha(KEY_ACME)}"

[tenants.globex]
""")
    server = start_server("--model", "dummy:tiny", "--config", str(config))
    yield server
    server.stop()


def _complete(server: ServerProcess, authorization: str | None, extra_headers: dict | None = None,
              **kwargs) -> httpx.Response:
    headers = {"authorization": authorization} if authorization is not None else {}
    headers.update(extra_headers or {})
    return httpx.post(f"{server.base_url}/v1/completions", headers=headers, timeout=60,
                      json={"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}, **kwargs)


def test_refused_tokens_are_401_and_logged_without_the_token(jwt_server, tokens):
    cases = refused_tokens(tokens)
    for name, (header, _) in cases.items():
        r = _complete(jwt_server, header)
        assert r.status_code == 401, (name, r.text)
        assert r.headers["www-authenticate"] == "Bearer" and r.json()["error"]["message"] == "invalid credentials"
    assert _complete(jwt_server, "Bearer " + tokens.token()).status_code == 200
    assert _complete(jwt_server, f"Bearer {KEY_ACME}").status_code == 200
    log = jwt_server.stdout + jwt_server.stderr
    for name, (header, reason) in cases.items():
        assert f"authentication failed from 127.0.0.1: {reason}" in log, name
        token = header.partition(" ")[2]
        for part in [token, *token.split(".")]:
            assert len(part) < 12 or part not in log, name
    metrics = httpx.get(f"{jwt_server.base_url}/metrics").text
    assert 'tenant="globex"' in metrics and 'tenant="acme"' in metrics


def test_grpc_takes_tokens_too(jwt_server, tokens):
    from rtxcore._generated import rtx_pb2, rtx_pb2_grpc

    request = rtx_pb2.GenerateRequest(token_ids=rtx_pb2.TokenIds(ids=[1, 2, 3]), max_tokens=2)
    with grpc.insecure_channel(jwt_server.grpc_target) as channel:
        stub = rtx_pb2_grpc.RtxStub(channel)
        outputs = list(stub.Generate(request, metadata=(("authorization", "Bearer " + tokens.token()),), timeout=30))
        assert outputs[-1].finished
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, metadata=(("authorization", "Bearer " + tokens.token(tenant="initech")),),
                               timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert refused.value.details() == "invalid credentials"
        # Credentials are checked before anything else, as over HTTP: a stranger learns not even the model's name.
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(rtx_pb2.GenerateRequest(token_ids=rtx_pb2.TokenIds(ids=[1]), max_tokens=2,
                                                       model="gpt-4"), timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_an_address_that_keeps_failing_is_refused_with_retry_after(jwt_server, tokens):
    # Runs last in this module: 127.0.0.1 stays refused for a while afterwards (one failure refills a minute).
    for _ in range(25):
        r = _complete(jwt_server, "Bearer sk-guess")
        if r.status_code == 429:
            break
        assert r.status_code == 401
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
    assert r.json()["error"]["code"] == "too_many_auth_failures"
    # Good credentials from that address wait too: a guesser cannot tell a hit from the limit.
    assert _complete(jwt_server, "Bearer " + tokens.token()).status_code == 429
    assert 'reason="auth_rate_limited"' in httpx.get(f"{jwt_server.base_url}/metrics").text


# -- behind a proxy -------------------------------------------------------------------------------------------------


def _proxy_server(tmp_path, *args: str) -> ServerProcess:
    config = tmp_path / "serve.toml"
    config.write_text(f'[auth]\nfailure_burst = 3\nfailures_per_minute = 1\n\n'
                      f'[tenants.acme]\nkey_sha256 = "{sha(KEY_ACME)}"\n')
    return start_server("--model", "dummy:tiny", "--config", str(config), *args)


def test_behind_a_trusted_proxy_one_guessing_client_locks_out_only_itself(tmp_path):
    """Every request through a load balancer comes from its address: one client guessing keys used to lock every
    tenant behind it out. From a trusted proxy (127.0.0.1 by default, as here), X-Forwarded-For names the client."""
    from rtxcore._generated import rtx_pb2, rtx_pb2_grpc

    server = _proxy_server(tmp_path)
    try:
        guesser, other = {"x-forwarded-for": "198.51.100.7"}, {"x-forwarded-for": "198.51.100.8"}
        codes = [_complete(server, "Bearer sk-guess", guesser).status_code for _ in range(5)]
        assert codes[-1] == 429 and set(codes) == {401, 429}, codes
        assert _complete(server, f"Bearer {KEY_ACME}", other).status_code == 200
        assert _complete(server, f"Bearer {KEY_ACME}", guesser).status_code == 429
        with grpc.insecure_channel(server.grpc_target) as channel:
            stub = rtx_pb2_grpc.RtxStub(channel)
            ok = list(stub.Generate(rtx_pb2.GenerateRequest(token_ids=rtx_pb2.TokenIds(ids=[1, 2, 3]), max_tokens=1),
                                    metadata=(("authorization", f"Bearer {KEY_ACME}"),
                                              ("x-forwarded-for", "198.51.100.9")), timeout=30))
            assert ok[-1].finished
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(rtx_pb2.GenerateRequest(token_ids=rtx_pb2.TokenIds(ids=[1, 2, 3]), max_tokens=1),
                                   metadata=(("authorization", f"Bearer {KEY_ACME}"),
                                             ("x-forwarded-for", "198.51.100.7")), timeout=30))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.stop()


def test_an_untrusted_peer_cannot_dodge_the_limit_with_x_forwarded_for(tmp_path):
    server = _proxy_server(tmp_path, "--forwarded-allow-ips", "10.0.0.0/8")  # 127.0.0.1 is no proxy of its
    try:
        codes = [_complete(server, "Bearer sk-guess", {"x-forwarded-for": f"198.51.100.{i}"}).status_code
                 for i in range(5)]
        assert codes[-1] == 429, codes
    finally:
        server.stop()


# -- mutual TLS -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtls(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtls")
    ca = TestCA(folder)
    server_files = ca.issue("server", {"CN": "localhost"}, server=True)
    config = folder / "serve.toml"
    config.write_text('[auth]\nauthenticators = ["mtls"]\n\n[tenants.acme]\n\n[tenants.globex]\n')
    server = start_server("--model", "dummy:tiny", "--config", str(config), "--ssl-certfile", str(server_files.cert),
                          "--ssl-keyfile", str(server_files.key), "--ssl-ca-certs", str(ca.cert),
                          "--ssl-cert-reqs", "required", wait_ready=False)
    clients = {name: ca.issue(name, {"CN": name, "O": "test"}) for name in ("acme", "initech")}
    clients["stranger"] = TestCA(folder, "other CA").issue("stranger", {"CN": "acme"})
    context = _client_context(ca.cert, clients["acme"])
    deadline = time.monotonic() + 180
    while not (server.ready_line() and _status(server, context, "/ready") == 200):
        assert server.proc.poll() is None and time.monotonic() < deadline, server.output()
        time.sleep(0.2)
    yield server, ca, clients
    server.stop()


def _client_context(ca_cert, client=None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca_cert))
    if client is not None:
        context.load_cert_chain(str(client.cert), str(client.key))
    return context


def _status(server, context, path: str) -> int | None:
    try:
        return httpx.get(server.base_url + path, verify=context, timeout=10).status_code
    except httpx.HTTPError:
        return None


def test_client_certificates_prove_tenants_over_https(mtls):
    server, ca, clients = mtls
    assert server.base_url.startswith("https://")
    acme = _client_context(ca.cert, clients["acme"])
    assert _complete(server, None, verify=acme).status_code == 200
    # A certificate the CA signed for a tenant the server does not know: 401, with the challenge the spec wants.
    r = _complete(server, None, verify=_client_context(ca.cert, clients["initech"]))
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Certificate"
    # No certificate, or one another CA signed: the handshake itself fails.
    for context in (_client_context(ca.cert), _client_context(ca.cert, clients["stranger"])):
        with pytest.raises(httpx.HTTPError):
            _complete(server, None, verify=context)
    assert "authentication failed from 127.0.0.1: mtls: client certificate names an unknown tenant 'initech'" in (
        server.stderr)
    assert 'tenant="acme"' in httpx.get(server.base_url + "/metrics", verify=acme).text


def test_client_certificates_prove_tenants_over_grpc(mtls):
    from rtxcore._generated import rtx_pb2, rtx_pb2_grpc

    server, ca, clients = mtls
    request = rtx_pb2.GenerateRequest(token_ids=rtx_pb2.TokenIds(ids=[1, 2, 3]), max_tokens=2)

    def generate(client):
        credentials = grpc.ssl_channel_credentials(ca.cert.read_bytes(), client.key.read_bytes(),
                                                   client.cert.read_bytes())
        with grpc.secure_channel(server.grpc_target, credentials) as channel:
            return list(rtx_pb2_grpc.RtxStub(channel).Generate(request, timeout=30))

    assert generate(clients["acme"])[-1].finished
    with pytest.raises(grpc.RpcError) as refused:
        generate(clients["initech"])
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
