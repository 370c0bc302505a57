"""Trusted proxies: the peers whose ``X-Forwarded-For`` says who the client is (``rtx serve --forwarded-allow-ips``).

Behind a load balancer or an Ingress every request comes from the proxy's address, so anything counted per address
(failed authentications, which lock an address out for a while) would count every client together: one client
guessing keys would lock out the others. From a trusted proxy, the client is the right-most address of
``X-Forwarded-For`` that is not itself a trusted proxy. Uvicorn applies this to HTTP (given the same list); gRPC
calls carry the header as ``x-forwarded-for`` metadata and are read here.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from rtxcore.errors import ConfigError

# What uvicorn trusts when told nothing: a proxy on the same host (a sidecar).
DEFAULT_TRUSTED = ("127.0.0.1",)

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class TrustedProxies:
    def __init__(self, entries: Sequence[str] = DEFAULT_TRUSTED):
        """:param entries: addresses, networks (``10.0.0.0/8``) or ``*`` (any peer).

        :raises ConfigError: an entry that is neither, named (uvicorn would read it as a host name and never match).
        """
        self.entries = tuple(entries)
        self.any = "*" in self.entries
        self.networks: list[_Network] = []
        for entry in self.entries:
            if entry == "*":
                continue
            try:
                # strict: uvicorn reads 10.0.0.1/8 (host bits set) as a host name that never matches, so HTTP would
                # ignore what gRPC believed.
                self.networks.append(ipaddress.ip_network(entry))
            except ValueError:
                raise ConfigError(f"--forwarded-allow-ips: {entry!r} is not an IP address or network (e.g. "
                                  "10.0.0.0/8, with no host bits set), nor '*'") from None

    def for_uvicorn(self) -> list[str]:
        """The same list as uvicorn's forwarded_allow_ips takes it (it trusts any peer only for exactly ["*"])."""
        return ["*"] if self.any else list(self.entries)

    def trusts(self, address: str) -> bool:
        if self.any:
            return True
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        # A dual-stack socket (--host ::) sees IPv4 peers as ::ffff:10.1.2.3.
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        return any(ip in network or (mapped is not None and mapped in network) for network in self.networks)

    def client(self, peer: str | None, forwarded_for: str | None) -> str | None:
        """The client's address: ``peer``, unless it is a trusted proxy that forwarded the request; then the right-most
        address of ``forwarded_for`` that is not a trusted proxy (the left-most if all are)."""
        if peer is None or not forwarded_for or not self.trusts(peer):
            return peer
        hops = [hop.strip() for hop in forwarded_for.split(",") if hop.strip()]
        for hop in reversed(hops):
            if not self.trusts(hop):
                return hop
        return hops[0] if hops else peer
