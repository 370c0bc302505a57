"""The request lifecycle every protocol shares, with no protocol in it.

A request comes in through a thin adapter (``rtxcore.server.http`` or ``rtxcore.server.grpc``) that parses it and
calls here: the runtime checks the engine is ready (``runtime``), the tenant's lane is resolved (``routing``), the
prompts are tokenized and admitted against the tenant's and the server's limits and the scheduler (``generation``),
the request is journaled and its events produced and followed (``lifecycle``, ``served_request``, ``formats``), and
after a restart the journal brings unfinished requests back (``recovery``, ``durable/``). Every failure is a
:class:`rtxcore.errors.RequestError`, which each adapter maps to its own status codes in one place.
"""
