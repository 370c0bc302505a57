"""The rtx-serve plugin contract: one hook per plugin kind.

Each hook receives a ``register`` callback. Call it once per component the plugin provides::

    @hookimpl
    def register_eviction_policies(register):
        register("lru", LRUPolicy)

``register(name, cls)`` checks that ``cls`` implements the kind's contract (:mod:`rtxcore.contracts`), refuses a
name already taken, and records which package provided it so ``rtx plugins list`` can show it.
"""

from __future__ import annotations

from typing import Callable

import pluggy

PROJECT_NAME = "rtx"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[[str, type], None]


@hookspec
def register_schedulers(register: Register) -> None:
    """Register scheduler classes (subclasses of :class:`rtxcore.contracts.Scheduler`).

    :param register: call ``register(name, cls)`` for each scheduler; ``cls(config, kv_cache)`` must build one.
    :returns: nothing; results go through ``register``.
    """


@hookspec
def register_eviction_policies(register: Register) -> None:
    """Register KV-cache eviction policies (subclasses of :class:`rtxcore.contracts.EvictionPolicy`).

    :param register: call ``register(name, cls)`` for each policy; ``cls(capacity)`` must build one.
    :returns: nothing; results go through ``register``.
    """


@hookspec
def register_samplers(register: Register) -> None:
    """Register samplers (subclasses of :class:`rtxcore.contracts.Sampler`).

    :param register: call ``register(name, cls)`` for each sampler; ``cls()`` must build one.
    :returns: nothing; results go through ``register``.
    """


@hookspec
def register_quantizers(register: Register) -> None:
    """Register weight quantizers (subclasses of :class:`rtxcore.contracts.Quantizer`).

    :param register: call ``register(name, cls)`` for each quantizer; ``cls()`` must build one.
    :returns: nothing; results go through ``register``.
    """


@hookspec
def register_backends(register: Register) -> None:
    """Register execution backends (subclasses of :class:`rtxcore.contracts.ExecutionBackend`).

    A backend whose runtime is missing still registers; its ``capabilities()`` reports it unavailable with the reason.

    :param register: call ``register(name, cls)`` for each backend; ``cls(options)`` must build one.
    :returns: nothing; results go through ``register``.
    """


@hookspec
def register_proposers(register: Register) -> None:
    """Register speculative-decoding proposers (subclasses of :class:`rtxcore.contracts.Proposer`).

    :param register: call ``register(name, cls)`` for each proposer; ``cls(context)`` must build one, with a
        :class:`rtxcore.contracts.proposer.ProposerContext`.
    :returns: nothing; results go through ``register``.
    """


@hookspec
def register_logits_processors(register: Register) -> None:
    """Register logits processors (subclasses of :class:`rtxcore.contracts.LogitsProcessor`).

    :param register: call ``register(name, cls)`` for each processor; ``cls(context)`` must build one, with a
        :class:`rtxcore.contracts.logits_processor.LogitsProcessorContext`. A request asks for it by that name.
    :returns: nothing; results go through ``register``.
    """


@hookspec
def register_authenticators(register: Register) -> None:
    """Register authenticators (subclasses of :class:`rtxcore.contracts.Authenticator`): from a request's
    credentials, the tenant that sent it.

    :param register: call ``register(name, cls)`` for each authenticator; ``cls(context)`` must build one, with an
        :class:`rtxcore.contracts.authenticator.AuthenticatorContext`. ``[auth] authenticators`` picks them by name.
    :returns: nothing; results go through ``register``.
    """
