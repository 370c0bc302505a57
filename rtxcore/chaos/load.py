"""The load a drill runs its fault under: streaming greedy requests on ``/generate`` that keep going through the
fault as a careful client would (a refused request is sent again after ``Retry-After``; an accepted stream whose
connection breaks is resumed with ``Last-Event-ID``), and what each one saw, to count what was lost or duplicated.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

# A refused request waits this long at most before it is sent again, whatever Retry-After says.
MAX_RETRY_WAIT_S = 1.0


@dataclass
class Target:
    """Where the server is now: a drill that restarts it points its clients at the new address."""

    base_url: str


def prompt_of(index: int, length: int = 12) -> list[int]:
    rng = random.Random(index)
    return [rng.randrange(1, 500) for _ in range(length)]


@dataclass
class Stream:
    """One streaming request and everything it saw, as ``(event id, payload)``."""

    index: int
    max_tokens: int
    # Extra request fields (a logits processor that fails it, say).
    extra: dict[str, Any] = field(default_factory=dict)
    # Stop reading (close the connection) after this many events, once; None reads to the end.
    leave_after: int | None = None
    # Resume a broken stream (the server keeps a journal); without, a broken stream is over.
    resumable: bool = True
    req_id: str | None = None
    events: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    # 429/503 answers to the opening request: it was never accepted, and was sent again.
    refusals: int = 0
    # A status that is neither 200 nor a refusal, or an error event: how the request ended if it failed.
    error: str | None = None
    sent_at: float = 0.0
    accepted_at: float | None = None
    first_token_at: float | None = None
    left: bool = False
    # The last connection error, for a report of a stream that ended without finishing.
    broken_by: str | None = None
    thread: threading.Thread | None = None

    @property
    def finished(self) -> bool:
        return bool(self.events) and bool(self.events[-1][1].get("finished"))

    @property
    def token_ids(self) -> list[int]:
        return [t for _, event in self.events for t in event.get("token_ids", ())]

    def event_ids(self) -> list[int]:
        return [event_id for event_id, _ in self.events]

    def body(self) -> dict[str, Any]:
        return {"prompt": prompt_of(self.index), "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, **self.extra}

    def start(self, target: Target, deadline: float) -> None:
        self.thread = threading.Thread(target=self.run, args=(target, deadline), daemon=True,
                                       name=f"chaos-stream-{self.index}")
        self.thread.start()

    def run(self, target: Target, deadline: float) -> None:
        """Until it ends (finished, failed, left) or ``deadline`` passes."""
        self.sent_at = time.monotonic()
        while time.monotonic() < deadline and not self._over():
            try:
                if self.req_id is None:
                    self._open(target.base_url, deadline)
                elif self.resumable:
                    self._resume(target.base_url, deadline)
                else:
                    return
            except (httpx.HTTPError, OSError) as exc:
                self.broken_by = f"{type(exc).__name__}: {exc}"[:200]
                time.sleep(0.1)  # the server went away: wait for it (or its restart) and go on

    def _over(self) -> bool:
        return self.finished or self.error is not None or self.left

    def _open(self, base_url: str, deadline: float) -> None:
        with httpx.stream("POST", base_url + "/generate", json=self.body(), timeout=_timeout(deadline)) as resp:
            if resp.status_code in (429, 503):
                self.refusals += 1
                resp.read()
                time.sleep(min(MAX_RETRY_WAIT_S, float(resp.headers.get("retry-after", 0.2))))
                return
            if resp.status_code != 200:
                self.error = f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
                return
            self.req_id = resp.headers["x-rtx-request-id"]
            self.accepted_at = time.monotonic()
            self._read(resp)

    def _resume(self, base_url: str, deadline: float) -> None:
        last = self.events[-1][0] if self.events else 0
        with httpx.stream("GET", f"{base_url}/v1/streams/{self.req_id}", headers={"Last-Event-ID": str(last)},
                          timeout=_timeout(deadline)) as resp:
            if resp.status_code in (429, 503):
                resp.read()
                time.sleep(0.1)
                return
            if resp.status_code != 200:
                self.error = f"resume: HTTP {resp.status_code}: {resp.read()[:200]!r}"
                return
            self._read(resp)

    def _read(self, resp: httpx.Response) -> None:
        event_id = 0
        for line in resp.iter_lines():
            if line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("data: ") and line != "data: [DONE]":
                payload = json.loads(line[6:])
                self.events.append((event_id, payload))
                if "error" in payload:
                    self.error = json.dumps(payload["error"])[:300]
                    return
                if self.first_token_at is None and payload.get("token_ids"):
                    self.first_token_at = time.monotonic()
                if self.leave_after is not None and len(self.events) >= self.leave_after:
                    self.left = True
                    return


def _timeout(deadline: float) -> httpx.Timeout:
    return httpx.Timeout(max(1.0, deadline - time.monotonic()), connect=5.0)


def reference_tokens(base_url: str, index: int, max_tokens: int, attempts: int = 3) -> list[int]:
    """What an undisturbed greedy run of stream ``index``'s prompt gives (a stream: its events carry token ids).

    A reference whose connection breaks (a 2-core machine under a full test run can stall the server past a
    client's patience) is sent again from the start rather than resumed: a resumed run is what the drill checks, so
    it cannot be the reference."""
    seen = []
    for _ in range(attempts):
        stream = Stream(index, max_tokens, resumable=False)
        stream.run(Target(base_url), time.monotonic() + 120)
        if stream.finished:
            return stream.token_ids
        seen.append(f"{len(stream.events)} events, {stream.error or stream.broken_by or 'deadline'}")
    raise RuntimeError(f"the reference run of stream {index} did not finish in {attempts} attempts: "
                       + "; ".join(seen))


def duplicated_events(stream: Stream) -> int:
    """Events whose id was seen before (a resumed stream must continue after the last one, never repeat it)."""
    ids = stream.event_ids()
    return len(ids) - len(set(ids))


def missing_events(stream: Stream) -> int:
    """Event ids skipped: a finished stream's ids run 1, 2, ... without a gap."""
    ids = sorted(set(stream.event_ids()))
    return (ids[-1] - len(ids)) if ids else 0


class ReadinessProbe:
    """Polls ``/ready`` as a load balancer would; :meth:`not_ready_s` is the time it answered anything but 200."""

    def __init__(self, target: Target, interval_s: float = 0.05):
        self.target = target
        self.interval_s = interval_s
        self.samples: list[tuple[float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="chaos-probe")

    def __enter__(self) -> ReadinessProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ok = httpx.get(self.target.base_url + "/ready", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                ok = False
            self.samples.append((time.monotonic(), ok))
            self._stop.wait(self.interval_s)

    def not_ready_s(self) -> float:
        total, previous = 0.0, None
        for at, ok in self.samples:
            if previous is not None and not previous[1]:
                total += at - previous[0]
            previous = (at, ok)
        return total

    def ready_after(self, moment: float) -> float | None:
        """Seconds from ``moment`` to the first 200 after it; None if none came."""
        return next((at - moment for at, ok in self.samples if at >= moment and ok), None)
