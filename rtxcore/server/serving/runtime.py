"""What the HTTP and gRPC servers share: the engine (loaded in the background), metrics, tenants, the request
journal and the server's admission limit.

Servers start listening before the model is loaded so that probes get answers at once: the process is alive, and
every model call is refused as UNAVAILABLE (:meth:`ServingRuntime.engine`) until :attr:`ServingRuntime.ready`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from rtxcore.engine.async_engine import AsyncEngine
from rtxcore.engine.config import EngineConfig
from rtxcore.errors import ErrorCode, RequestError
from rtxcore.models.resolve import DEFAULT_MODEL
from rtxcore.server.serving.authentication import Authentication
from rtxcore.server.serving.limits import RETRY_AFTER_S
from rtxcore.server.serving.settings import ServeSettings
from rtxcore.server.serving.tenants import TenantRegistry

if TYPE_CHECKING:
    from rtxcore.server.serving.durable.registry import DurableRequests

log = logging.getLogger("rtx.server")


class ServingRuntime:
    def __init__(self, engine_config: EngineConfig, settings: ServeSettings | None = None,
                 tenants: TenantRegistry | None = None, progress: Callable[[int, int], None] | None = None,
                 auth: Authentication | None = None):
        from rtxcore.metrics import EngineMetrics
        from rtxcore.metrics.gpu import register_gpu_metrics

        self.engine_config = engine_config
        self.settings = settings or ServeSettings()
        # Tenants and their limits; an empty registry serves unauthenticated.
        self.tenants = tenants or TenantRegistry([])
        # Who sent a request; by default the tenants' API keys (none configured: an open server).
        self.auth = auth or Authentication.from_config(None, self.tenants)
        # Told (done, total) as the weights load: `rtx serve`'s progress bar; None says nothing.
        self.progress = progress
        self.model_name = self.settings.served_model_name or engine_config.model or DEFAULT_MODEL
        self.backend_name = engine_config.backend
        self.metrics = EngineMetrics(self.model_name)
        self.metrics.set_lane_targets(engine_config.scheduling.lanes.values())
        register_gpu_metrics(self.metrics.registry)
        self.async_engine: AsyncEngine | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        # Names a request's ``model`` may give: the served name, plus the source's own names once loaded.
        self.model_aliases: set[str] = {self.model_name, *self.settings.served_model_aliases}
        self.started_at = int(time.time())
        self._loaded = threading.Event()
        self._lock = threading.Lock()
        self._num_admitted = 0
        # Resumable requests and their journal; None without a state dir. Used from the servers' event loop only.
        self.durable = self._make_durable()

    def _make_durable(self) -> DurableRequests | None:
        if self.settings.state_dir is None:
            return None
        from rtxcore.server.serving.durable.journal import Journal, JournalOptions
        from rtxcore.server.serving.durable.metrics import register
        from rtxcore.server.serving.durable.registry import DurableRequests

        options = JournalOptions(retention_s=self.settings.journal_retention_s,
                                 compact_min_bytes=self.settings.journal_compact_min_bytes)
        durable = DurableRequests(Journal(Path(self.settings.state_dir) / "journal", options))
        register(self.metrics.registry, durable, lambda: self.model_name)
        return durable

    # -- loading --------------------------------------------------------------------------------------------------

    def load(self) -> None:
        """Load the model and start the engine thread (blocking). Errors are kept in :attr:`load_error`."""
        from rtxcore.engine.core import EngineCore
        from rtxcore.models.resolve import resolve_model
        from rtxcore.provenance.signing import check_model_signature, verify_model

        try:
            # Verified here, where it is loaded, so that an embedding application gets the same check as the CLI.
            source = resolve_model(self.engine_config.model, self.engine_config.revision)
            policy = self.settings.signing_policy()
            check_model_signature(source.origin, policy)
            if policy.public_key is not None:
                # Exports and engines cached on disk are checked too: reused only with a valid signature.
                self.engine_config.verify_artifact = partial(verify_model, public_key=policy.public_key)
            engine = EngineCore(self.engine_config, source=source, progress=self.progress)
            if self.settings.served_model_name is None:
                self.model_name = engine.source.name
                self.metrics.set_model_name(self.model_name)
            self.model_aliases |= {self.model_name, engine.source.name}
            if self.engine_config.model:
                self.model_aliases.add(self.engine_config.model)
            if engine.source.name == DEFAULT_MODEL:
                self.model_aliases.add("default")
            async_engine = AsyncEngine(engine, observers=[self.metrics.observer()])
            async_engine.start()
            self.async_engine = async_engine
            log.info("serving model %s on backend %s", self.model_name, self.backend_name)
        except BaseException as exc:
            self.load_error = exc
            log.debug("model failed to load", exc_info=True)  # reported by whoever waits on load_error
        finally:
            self._loaded.set()

    def start_loading(self) -> threading.Thread:
        thread = threading.Thread(target=self.load, name="rtx-model-loader", daemon=True)
        thread.start()
        return thread

    def wait_loaded(self, timeout: float | None = None) -> bool:
        return self._loaded.wait(timeout)

    @property
    def ready(self) -> bool:
        # Not ready while the journal's disk refuses writes: new requests would be refused (503) anyway.
        return (self.async_engine is not None and self.async_engine.is_running and not self.draining
                and (self.durable is None or (self.durable.recovered and not self.durable.journal.degraded)))

    @property
    def state(self) -> str:
        """``loading``, ``serving``, ``draining`` or ``failed`` (nothing in this process will serve again)."""
        if self.draining:
            return "draining"
        if self.load_error is not None:
            return "failed"
        if self.async_engine is None:
            return "loading"
        return "serving" if self.async_engine.is_running else "failed"

    def engine(self) -> AsyncEngine:
        """The running engine.

        :raises RequestError: UNAVAILABLE while loading, draining or resuming the journal (with a retry delay), or
            for good once the model failed to load or the engine stopped.
        """
        if self.draining:
            raise _unavailable("the server is shutting down", RETRY_AFTER_S)
        engine = self.async_engine
        if engine is None:
            if self.load_error is not None:
                raise _unavailable(f"the model failed to load: {self.load_error}")
            raise _unavailable("the model is still loading", RETRY_AFTER_S)
        if not engine.is_running:
            raise _unavailable(f"the engine has stopped: {engine.error!r}")
        if self.durable is not None and not self.durable.recovered:
            raise _unavailable("resuming the requests of the journal", RETRY_AFTER_S)
        return engine

    def check_ready(self) -> None:
        """What ``/ready`` asks: the engine runs, and new requests can be journaled.

        :raises RequestError: UNAVAILABLE, as :meth:`engine` says, or while the journal's disk refuses writes.
        """
        self.engine()
        if self.durable is not None and self.durable.journal.degraded:
            raise _unavailable("the request journal cannot be written: new requests wait until it can",
                               RETRY_AFTER_S)

    def check_model(self, model: str | None) -> None:
        """:raises RequestError: NOT_FOUND for a model this server does not serve (None means the served one)."""
        if model is not None and model not in self.model_aliases:
            raise RequestError(ErrorCode.NOT_FOUND, f"model {model!r} does not exist; this server serves "
                               f"{self.model_name!r}", param="model", reason="model_not_found")

    # -- admission ------------------------------------------------------------------------------------------------

    def try_admit(self, num_requests: int = 1) -> bool:
        """Take ``num_requests`` slots of ``settings.max_active_requests``; False (taking none) when full.

        Servers call this before submitting and :meth:`release` once the requests' responses are done, so that a
        burst of arrivals cannot overshoot the limit while the engine thread has yet to accept them.
        """
        engine_active = self.async_engine.num_active if self.async_engine is not None else 0
        with self._lock:
            if max(self._num_admitted, engine_active) + num_requests > self.settings.max_active_requests:
                return False
            self._num_admitted += num_requests
            return True

    def force_admit(self, num_requests: int) -> None:
        """Take slots even past the limit: for requests admitted before a restart and resumed now."""
        with self._lock:
            self._num_admitted += num_requests

    def release(self, num_requests: int = 1) -> None:
        with self._lock:
            self._num_admitted -= num_requests

    @property
    def num_active(self) -> int:
        """Requests admitted and not yet answered in full (what a graceful shutdown waits for)."""
        engine_active = self.async_engine.num_active if self.async_engine is not None else 0
        return max(self._num_admitted, engine_active)

    def stop(self) -> None:
        if self.async_engine is not None:
            self.async_engine.stop()
            if not self.async_engine.is_running and self.async_engine.error is None:
                self._save_kv_snapshot()
        if self.durable is not None:
            self.durable.close()  # after the engine: nothing writes to the journal any more

    def _save_kv_snapshot(self) -> None:
        """With a disk KV tier, write the prefix cache there (the engine thread has stopped), so the next start is
        warm; a failure is logged, never raised: the shutdown must go on."""
        if self.async_engine is None:
            return
        try:
            self.async_engine.core.save_kv_snapshot()
        except Exception:
            log.exception("could not write the KV cache snapshot at shutdown")


def _unavailable(message: str, retry_after_s: float | None = None) -> RequestError:
    return RequestError(ErrorCode.UNAVAILABLE, message, retry_after_s=retry_after_s, reason="not_ready")
