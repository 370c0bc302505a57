"""The restart drill of the reliability gate: ``rtx serve --state-dir`` on the default model killed with SIGKILL
under load, restarted on the same state dir, every client picking up where it was.

Streams (``/generate`` and OpenAI completions, some still read, some whose client left) resume with
``Last-Event-ID``; full responses are fetched again by their ``Idempotency-Key``. Counted: requests lost, events
missing or twice, tokens generated twice (the engine must produce only what was left of each request); timed: the
restart's time to ready against the first start's; and the prefix cache the restart brings back (the same
conversations' hit rate against the rate before the kill). Greedy outputs are compared with uninterrupted runs too,
for information: with real weights a re-prefilled request may break a near tie differently.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rtxcore.bench.loadgen.workload import MAX_LENGTH_TOKENS
from rtxcore.gates.outcome import Check
from rtxcore.gates.served import ServedProcess
from rtxcore.gates.thresholds import require
from rtxcore.server.serving.durable.records import decode_records

GATE = "reliability"
_TIMEOUT = 300
# The most streams, full requests or conversations of the drill: each is a thread and a connection of its own, and
# the server's batch (--max-num-seqs) is 256 by default.
MAX_DRILL_CLIENTS = 256


@dataclass(frozen=True, slots=True)
class ReliabilitySettings:
    """``[phase.reliability]``: the overload run (on the latency gate's server, rtxcore.gates.online) and the drill."""

    overload: float
    overload_duration_s: float
    num_streams: int
    num_full: int
    max_tokens: int
    num_conversations: int
    max_ready_ratio: float
    min_hit_rate_recovery: float

    def __post_init__(self) -> None:
        for key in ("overload", "overload_duration_s", "max_ready_ratio"):
            require(getattr(self, key) > 0, key, "> 0", getattr(self, key))
        require(self.min_hit_rate_recovery >= 0, "min_hit_rate_recovery", ">= 0", self.min_hit_rate_recovery)
        for key, low in (("num_streams", 1), ("num_full", 0), ("num_conversations", 1)):
            value = getattr(self, key)
            require(low <= value <= MAX_DRILL_CLIENTS, key, f"from {low} to {MAX_DRILL_CLIENTS}", value)
        require(1 <= self.max_tokens <= MAX_LENGTH_TOKENS, "max_tokens", f"from 1 to {MAX_LENGTH_TOKENS:,}",
                self.max_tokens)


def _prompt(index: int) -> list[int]:
    rng = random.Random(index)
    return [rng.randrange(100, 4000) for _ in range(12)]


@dataclass
class _Stream:
    index: int
    native: bool
    # Stop reading (the client leaves) after this many events; None reads until the connection dies.
    read_at_most: int | None
    max_tokens: int
    req_id: str | None = None
    events: list[tuple[int, Any]] = field(default_factory=list)
    thread: threading.Thread | None = None

    def body(self) -> dict[str, Any]:
        body = {"prompt": _prompt(self.index), "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        return body if self.native else {**body, "logprobs": 0}

    def start(self, base_url: str) -> None:
        self.thread = threading.Thread(target=self._run, args=(base_url,), daemon=True)
        self.thread.start()

    def _run(self, base_url: str) -> None:
        try:
            path = "/generate" if self.native else "/v1/completions"
            with httpx.stream("POST", base_url + path, json=self.body(), timeout=_TIMEOUT, trust_env=False) as resp:
                if resp.status_code == 200:
                    self.req_id = resp.headers["x-rtx-request-id"]
                    self._read(resp)
        except httpx.HTTPError:
            pass  # the server was killed under it

    def resume(self, base_url: str) -> None:
        last = self.events[-1][0] if self.events else 0
        self.read_at_most = None
        try:
            with httpx.stream("GET", f"{base_url}/v1/streams/{self.req_id}", headers={"Last-Event-ID": str(last)},
                              timeout=_TIMEOUT, trust_env=False) as resp:
                if resp.status_code == 200:
                    self._read(resp)
        except httpx.HTTPError:
            pass  # counted as events missing

    def _read(self, resp: httpx.Response) -> None:
        event_id = 0
        for line in resp.iter_lines():
            if line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("data: "):
                data = line[6:]
                self.events.append((event_id, data if data == "[DONE]" else json.loads(data)))
                if self.read_at_most is not None and len(self.events) >= self.read_at_most:
                    return

    def complete_once(self) -> bool:
        """Every event once, in order, and the stream's end."""
        ids = [event_id for event_id, _ in self.events]
        last = self.events[-1][1] if self.events else None
        ended = last is not None and (last["finished"] if self.native else last == "[DONE]")
        return ids == list(range(1, len(ids) + 1)) and ended

    def output(self) -> str:
        if self.native:
            return json.dumps([t for _, e in self.events for t in e["token_ids"]])
        return "".join(c["text"] for _, e in self.events if e != "[DONE]" for c in e["choices"])


@dataclass
class _Full:
    index: int
    max_tokens: int
    response: httpx.Response | None = None
    thread: threading.Thread | None = None

    def start(self, base_url: str) -> None:
        self.thread = threading.Thread(target=self.post, args=(base_url,), daemon=True)
        self.thread.start()

    def post(self, base_url: str) -> None:
        body = {"prompt": _prompt(self.index), "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
        try:
            self.response = httpx.post(base_url + "/v1/completions", json=body, timeout=_TIMEOUT, trust_env=False,
                                       headers={"Idempotency-Key": f"gates-full-{self.index}"})
        except httpx.HTTPError:
            self.response = None  # the server was killed under it

    def output(self) -> str | None:
        if self.response is None or self.response.status_code != 200:
            return None
        return self.response.json()["choices"][0]["text"]


@dataclass
class _Conversation:
    index: int
    history: list[int] = field(default_factory=list)

    def turn(self, base_url: str) -> tuple[int, int]:
        """The next turn (the first a long document, later ones a short message); (prompt tokens, of those cached)."""
        rng = random.Random(1000 + self.index * 100 + len(self.history))
        prompt = self.history + [rng.randrange(100, 4000) for _ in range(24 if self.history else 400)]
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
        reply: list[int] = []
        usage: dict[str, Any] = {}
        with httpx.stream("POST", base_url + "/generate", json=body, timeout=_TIMEOUT, trust_env=False) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    reply += event["token_ids"]
                    usage = event.get("usage", usage)
        self.history = prompt + reply
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def _hit_rate(conversations: list[_Conversation], base_url: str) -> float:
    """Cached prompt tokens over prompt tokens of one round: every conversation's next turn."""
    counts = [c.turn(base_url) for c in conversations]
    return sum(cached for _, cached in counts) / max(1, sum(total for total, _ in counts))


def _records(state_dir: Path) -> list[dict[str, Any]]:
    path = state_dir / "journal" / "journal.log"
    return decode_records(path.read_bytes()).records if path.exists() else []


def _wait(condition, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"restart drill: timed out waiting for {what}")
        time.sleep(0.05)


def run(settings: ReliabilitySettings, workdir: Path, say) -> list[Check]:
    state_dir = workdir / "state"
    args = ["--state-dir", str(state_dir), "--kv-snapshot-interval", "0.5"]
    log = workdir / "restart-server.log"
    say("reliability: kill -9 drill: starting rtx serve --state-dir...")
    server = ServedProcess(args, log)
    cold_ready_s = server.ready_s
    conversations = [_Conversation(i) for i in range(settings.num_conversations)]
    try:
        _hit_rate(conversations, server.base_url)
        warm_rate = _hit_rate(conversations, server.base_url)
        # Their histories are in a snapshot once the snapshot counter covers their full blocks.
        history_blocks = sum(len(c.history) // 16 for c in conversations)
        _wait(lambda: server.metric("rtx_kv_snapshot_blocks_total") >= history_blocks, "the KV snapshot")
        accepted_before = sum(r["t"] == "accept" for r in _records(state_dir))
        n = settings.num_streams
        streams = [_Stream(i, native=i % 2 == 0, read_at_most=None if i < n // 2 else 3,
                           max_tokens=settings.max_tokens) for i in range(n)]
        fulls = [_Full(n + i, settings.max_tokens) for i in range(settings.num_full)]
        clients: list[_Stream | _Full] = [*streams, *fulls]
        for client in clients:
            client.start(server.base_url)
        _wait(lambda: sum(r["t"] == "accept" for r in _records(state_dir)) == accepted_before + n + len(fulls),
              "every request's accept record")
        _wait(lambda: all(len(s.events) >= 3 for s in streams), "three events of every stream")
        say("reliability: kill -9 with every request in flight...")
        server.kill()
    finally:
        server.kill()
    for client in clients:
        if client.thread is not None:
            client.thread.join(30)
    before = _records(state_dir)
    unfinished = {r["id"] for r in before if r["t"] == "accept"} - {r["id"] for r in before if r["t"] == "finish"}
    produced = sum(len(r["o"]["tok"]) for r in before if r["t"] == "out" and "o" in r and r["id"] in unfinished)

    say("reliability: restarting on the same state dir...")
    with ServedProcess(args, log) as server:
        ready_ratio = server.ready_s / cold_ready_s
        resumed = server.metric("rtx_journal_resumed_requests_total")
        resumers = [threading.Thread(target=s.resume, args=(server.base_url,)) for s in streams]
        for thread in resumers:
            thread.start()
        for full in fulls:
            full.post(server.base_url)
        for thread in resumers:
            thread.join(_TIMEOUT)
        generated_after = server.metric("rtx_generation_tokens_total")
        recovered_rate = _hit_rate(conversations, server.base_url)
        outputs_equal = sum(_uninterrupted(server.base_url, c) == c.output() for c in clients)
    after = _records(state_dir)
    finished = [r["id"] for r in after if r["t"] == "finish"]
    lost = sum(1 for req in unfinished if req not in finished) + sum(f.output() is None for f in fulls)
    broken = sum(not s.complete_once() for s in streams) + sum(finished.count(req) > 1 for req in unfinished)
    twice = abs(generated_after - (len(unfinished) * settings.max_tokens - produced))
    in_flight = f"{len(unfinished)} of {n + len(fulls)} requests in flight at the kill, {int(resumed)} resumed"
    return [
        Check(GATE, "kill -9: requests lost", lost, 0, "<=", in_flight),
        Check(GATE, "kill -9: streams with an event missing or twice", broken, 0, "<=",
              f"{outputs_equal} of {n + len(fulls)} outputs equal an uninterrupted run's"),
        Check(GATE, "kill -9: tokens generated twice (or never)", twice, 0, "<=",
              f"{int(generated_after)} generated after the restart, {produced} before it"),
        Check(GATE, "restart: time to ready / first start's", ready_ratio, settings.max_ready_ratio, "<=",
              f"first start {cold_ready_s:.1f} s, restart {ready_ratio * cold_ready_s:.1f} s"),
        Check(GATE, "restart: prefix hit rate / before the kill", recovered_rate / max(warm_rate, 1e-9),
              settings.min_hit_rate_recovery, ">=", f"before {warm_rate:.3f}, after {recovered_rate:.3f}"),
    ]


def _uninterrupted(base_url: str, client: _Stream | _Full) -> str:
    stream = _Stream(client.index, native=isinstance(client, _Stream) and client.native, read_at_most=None,
                     max_tokens=client.max_tokens)
    stream._run(base_url)
    return stream.output()
