"""An HTTP app on ``dummy:tiny`` with a request journal, run in process, and the crashes a test simulates on it: a
crash leaves a prefix of the journal's records (they are appended in order), which a fresh runtime reads."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from starlette.testclient import TestClient

from rtxcore.engine.config import EngineConfig
from rtxcore.server.http import build_app
from rtxcore.server.serving.durable.records import decode_records, encode_record
from rtxcore.server.serving.recovery import recover
from rtxcore.server.serving.runtime import ServeSettings, ServingRuntime
from rtxcore.server.serving.tenants import TenantRegistry


def make_runtime(state_dir: Path, tenants: TenantRegistry | None = None, **settings) -> ServingRuntime:
    runtime = ServingRuntime(EngineConfig(model="dummy:tiny"), ServeSettings(state_dir=str(state_dir), **settings),
                             tenants)
    runtime.load()
    assert runtime.load_error is None
    return runtime


@contextlib.contextmanager
def serving(runtime: ServingRuntime, app=None) -> Iterator[TestClient]:
    """The app on ``runtime`` after the journal's recovery, as the launcher runs it; stopped as on SIGTERM."""
    with TestClient(app or build_app(runtime)) as client:
        client.portal.call(recover, runtime)
        try:
            yield client
        finally:
            client.portal.call(runtime.durable.stop_producers)
    runtime.stop()


def events(body: str) -> list[tuple[int, str]]:
    """``(id, data)`` of each SSE event of a response body."""
    out = []
    for block in body.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((int(lines["id"]), lines["data"]))
    return out


def records(state_dir: Path) -> list[dict]:
    return decode_records((state_dir / "journal" / "journal.log").read_bytes()).records


def crash_copy(state_dir: Path, to: Path, keep) -> Path:
    """A state dir holding the records of ``state_dir`` for which ``keep(record, index)`` is true, as a crash
    would have left them."""
    kept = [r for i, r in enumerate(records(state_dir)) if keep(r, i)]
    (to / "journal").mkdir(parents=True)
    (to / "journal" / "journal.log").write_bytes(b"".join(encode_record(r) for r in kept))
    return to


# A request long enough to be running still when a test looks at it after a restart.
LONG_STREAM = {"prompt": [3, 14, 15], "max_tokens": 1500, "ignore_eos": True, "stream": True}


def crashed_mid_stream(tmp_path: Path, tenants=None, headers: dict | None = None) -> tuple[str, Path]:
    """A state dir (``tmp_path/b``) as a crash after LONG_STREAM's fourth event left it: the request id and the
    dir. ``tenants`` is a callable making the registry (each runtime gets its own)."""
    with serving(make_runtime(tmp_path / "a", tenants() if tenants else None)) as client:
        req_id = client.post("/generate", json=LONG_STREAM, headers=headers or {}).headers["x-rtx-request-id"]
    crashed = crash_copy(tmp_path / "a", tmp_path / "b",
                         lambda r, i: r["id"] == req_id and r["t"] != "finish" and r.get("seq", 0) <= 4)
    return req_id, crashed
