"""Which peer's X-Forwarded-For is believed, and which address it names (rtxcore.server.serving.proxies)."""

from __future__ import annotations

import pytest

from rtxcore.errors import ConfigError
from rtxcore.server.serving.proxies import TrustedProxies
from tests.helpers.cli import assert_one_line_error, run_in_process


def test_the_client_is_the_right_most_address_no_trusted_proxy_added():
    proxies = TrustedProxies(["10.0.0.0/8", "127.0.0.1"])
    # A client-made first entry is not believed: the last hop before our proxies is.
    assert proxies.client("10.1.2.3", "6.6.6.6, 198.51.100.7, 10.9.9.9") == "198.51.100.7"
    assert proxies.client("10.1.2.3", "198.51.100.7") == "198.51.100.7"
    assert proxies.client("10.1.2.3", None) == "10.1.2.3"
    assert proxies.client("10.1.2.3", "10.0.0.5, 10.0.0.6") == "10.0.0.5"  # all proxies: the first
    # From a peer that is no trusted proxy, the header is the client's own say: ignored.
    assert proxies.client("198.51.100.1", "203.0.113.9") == "198.51.100.1"
    assert TrustedProxies(["*"]).client("198.51.100.1", "203.0.113.9") == "203.0.113.9"
    assert TrustedProxies(["::1"]).client("::1", "2001:db8::7") == "2001:db8::7"
    assert proxies.client("::ffff:10.1.2.3", "198.51.100.7") == "198.51.100.7"  # a dual-stack socket's IPv4 peer


@pytest.mark.parametrize("entry", ["10.0.0.0/33", "ingress-nginx", "10.0.0.1,", "", "10.0.0.1/8"])
def test_an_entry_that_is_no_address_is_refused(entry):
    # uvicorn takes it as a host name that never matches, so a typo silently trusted nobody.
    with pytest.raises(ConfigError, match="is not an IP address or network"):
        TrustedProxies([entry])


def test_uvicorn_gets_the_list_it_understands():
    assert TrustedProxies(["10.0.0.0/8", "*"]).for_uvicorn() == ["*"]  # uvicorn: "*" only alone means any
    assert TrustedProxies(["10.0.0.0/8", "::1"]).for_uvicorn() == ["10.0.0.0/8", "::1"]


def test_the_flag_is_checked_before_anything_starts():
    proc = run_in_process("serve", "--model", "dummy:tiny", "--port", "0", "--no-grpc",
                          "--forwarded-allow-ips", "10.0.0.0/8,ingres")
    assert_one_line_error(proc, "--forwarded-allow-ips: 'ingres' is not an IP address or network")
