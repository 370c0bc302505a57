"""The authenticator contract: the built-ins pass it, and deliberately wrong authenticators are each caught naming
the rule they break."""

from __future__ import annotations

import pytest

from rtx_conformance.plugin import Selection
from rtx_conformance.report import render_table, summarize
from rtx_conformance.rules import rules_of
from rtx_conformance.runner import run_suite
from rtx_plugins.authenticators.api_key import ApiKeyAuthenticator
from rtxcore.contracts.authenticator import AuthenticationFailed, AuthenticatorExample, Credentials
from rtxcore.hookspecs import hookimpl
from rtxcore.registry import load_plugins

BUILTINS = ("api-key", "jwt", "mtls")


class AnyBearer(ApiKeyAuthenticator):
    """Takes any bearer token for the first tenant."""

    def authenticate(self, credentials: Credentials) -> str | None:
        return "acme" if credentials.bearer() else super().authenticate(credentials)


class SaysTheKey(ApiKeyAuthenticator):
    """Refuses an unknown key by quoting it: the server would log the secret."""

    def authenticate(self, credentials: Credentials) -> str | None:
        found = super().authenticate(credentials)
        if found is None and credentials.presented_secret():
            raise AuthenticationFailed(f"unknown key {credentials.presented_secret()}")
        return found


class RefusesNothing(ApiKeyAuthenticator):
    """Refuses when nothing is presented, which would stop the authenticators after it from being asked."""

    def authenticate(self, credentials: Credentials) -> str | None:
        if not credentials.presented_secret():
            raise AuthenticationFailed("no key")
        return super().authenticate(credentials)


class SplitsHeaders(ApiKeyAuthenticator):
    """Parses the header by hand and fails on one without a token."""

    def authenticate(self, credentials: Credentials) -> str | None:
        if (credentials.authorization or "").startswith("Bearer"):
            credentials = Credentials(api_key=credentials.authorization.split()[1])
        return super().authenticate(credentials)


class WrongTenant(ApiKeyAuthenticator):
    """Answers with a tenant of its own making."""

    def authenticate(self, credentials: Credentials) -> str | None:
        found = super().authenticate(credentials)
        return found.upper() if found else None


class NoExample(ApiKeyAuthenticator):
    @classmethod
    def example(cls) -> AuthenticatorExample:
        example = super().example()
        example.accepted = []
        return example


class TestAuthenticators:
    @hookimpl
    def register_authenticators(self, register):
        register("any-bearer", AnyBearer)
        register("says-the-key", SaysTheKey)
        register("refuses-nothing", RefusesNothing)
        register("splits-headers", SplitsHeaders)
        register("wrong-tenant", WrongTenant)
        register("no-example", NoExample)


@pytest.fixture(scope="module")
def authenticator_run():
    registry = load_plugins(extra=[("test-authenticators", TestAuthenticators())])
    return run_suite(registry, Selection(kinds=("authenticator",)))


def _results(run, name: str):
    return [r for r in run.session.results if (r.kind, r.name) == ("authenticator", name)]


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_authenticators_pass(authenticator_run, name):
    results = _results(authenticator_run, name)
    assert {r.check for r in results} == {"example", "accepts_its_examples", "refuses_junk_and_its_refused_examples",
                                          "nothing_presented_is_not_its_kind"}
    assert all(r.outcome == "passed" for r in results), [(r.check, r.message) for r in results]
    refused = next(r for r in results if r.check == "refuses_junk_and_its_refused_examples")
    assert refused.figures["refused"] > 50, refused.figures


@pytest.mark.parametrize("name, rule, detail", [
    ("any-bearer", "[authenticator.refuses]", "was taken for tenant 'acme'"),
    ("says-the-key", "[authenticator.reason_without_secret]", "repeats what was presented"),
    ("refuses-nothing", "[authenticator.nothing_presented]", "refused (no key) instead of returning None"),
    ("splits-headers", "[authenticator.api]", "raised IndexError"),
    ("wrong-tenant", "[authenticator.accepts]", "proves 'ACME', expected 'acme'"),
    ("no-example", "[authenticator.example]", "lists no credentials it accepts"),
])
def test_wrong_authenticator_is_caught_naming_the_rule(authenticator_run, name, rule, detail):
    failures = [r.message for r in _results(authenticator_run, name) if r.outcome == "failed"]
    assert any(rule in m and detail in m for m in failures), failures


def test_the_table_says_why(authenticator_run):
    assert not authenticator_run.passed
    table = render_table(summarize(authenticator_run.session))
    assert "FAILED authenticator any-bearer: [authenticator.refuses]" in table
    num_rules = len(rules_of("authenticator"))
    for name in BUILTINS:
        row = next(line for line in table.splitlines() if line.startswith(f"{name} "))
        assert f"pass ({num_rules}/{num_rules} rules)" in row, row
