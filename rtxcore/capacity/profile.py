"""A step-time profile: how long one engine step takes as a function of the tokens it computes (and, learnt live, of
the requests it computes them for), ``seconds = base_s + per_token_s * tokens + per_row_s * requests``
(rtxcore.capacity.step_time), and optionally how far real steps stray
from that line: the quantiles of their ratio to it, from which the simulation draws each step's time; and how long
requests spend on the serving side before and after the engine (rtxcore.capacity.serving_path), which the
simulation adds to each request's time to first token.

``measure`` times real steps of the model on this machine: decode steps of every batch size up to the engine's
``max_num_seqs`` (in powers of two) and prefill chunks up to its token budget, a least-squares fit over all of them
(no spread: each shape's time is a median on a quiet engine). ``from_server`` reads what a live server's engine
learnt from its own steps under real load, spread included.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from rtxcore.capacity.step_time import (
    DECODE,
    OTHER,
    SPREAD_QUANTILES,
    StepTimeModel,
    draw_quantile,
    draw_ratio,
    is_decode,
)
from rtxcore.engine.config import EngineConfig
from rtxcore.errors import ConfigError
from rtxcore.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class StepTimeProfile:
    base_s: float
    per_token_s: float
    # Where it came from (the machine and model, or "given"), for the report.
    source: str = "given"
    # Quantiles, at step_time.SPREAD_QUANTILES, of real steps' time over the prediction; empty: every step on it.
    # With decode_spread too, the steps that are not decodes; without, every step.
    spread: tuple[float, ...] = ()
    # Quantiles (the same) of requests' seconds outside the engine before their first token (capacity.serving_path):
    # from arrival at the server to submission, and from the first token to the event loop; empty: none.
    ingress: tuple[float, ...] = ()
    delivery: tuple[float, ...] = ()
    # Seconds per request the step computes for, beyond its tokens (0: tokens alone; see step_time.RowCostFit).
    per_row_s: float = 0.0
    # Decode steps' seconds by batch size where it was learnt (step_time.DecodeTimes): the line stands for the rest.
    decode_s: dict[int, float] = field(default_factory=dict)
    # The same quantiles for decode steps alone (step_time.STEP_KINDS); empty: they draw from ``spread``.
    decode_spread: tuple[float, ...] = ()

    def seconds(self, num_tokens: int, num_rows: int = 0) -> float:
        if is_decode(num_tokens, num_rows) and num_rows in self.decode_s:
            return self.decode_s[num_rows]
        return self.base_s + self.per_token_s * num_tokens + self.per_row_s * num_rows

    def draw(self, num_tokens: int, u: float, num_rows: int = 0) -> float:
        """One step's time, ``u`` uniform in [0, 1): the prediction's, times a ratio drawn from its kind's spread."""
        spread = self.decode_spread if self.decode_spread and is_decode(num_tokens, num_rows) else self.spread
        return self.seconds(num_tokens, num_rows) * draw_ratio(spread, u)

    def draw_serving_path(self, u_ingress: float, u_delivery: float) -> tuple[float, float]:
        """One request's (ingress, delivery) seconds, each ``u`` uniform in [0, 1); zeros without them."""
        return draw_quantile(self.ingress, u_ingress, 0.0), draw_quantile(self.delivery, u_delivery, 0.0)

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def load(cls, path: Path) -> StepTimeProfile:
        """The profile in JSON file ``path`` (as :meth:`to_json` writes it).

        :raises ConfigError: unreadable, not JSON, or a field missing, unknown or out of range, naming the file and
            the field.
        """
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read step-time profile {path}: {exc.strerror or exc}") from None
        except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
            raise ConfigError(f"step-time profile {path} is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"step-time profile {path} must be a JSON object {{base_s, per_token_s, ...}}, got "
                              f"{type(data).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(data.keys() - set(names))
        if unknown:
            raise ConfigError(f"step-time profile {path} has unknown field {unknown[0]!r} (fields: "
                              f"{', '.join(names)})")
        for name in ("base_s", "per_token_s"):
            if name not in data:
                raise ConfigError(f"step-time profile {path} has no {name}")

        def seconds(name: str, value: object) -> float:
            # Not nan or inf, which every check below would let through (nan compares false with anything).
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"step-time profile {path}: {name} must be a finite number >= 0, got {value!r}")
            return float(value)

        def series(name: str) -> tuple[float, ...]:
            values = data.get(name, [])
            if not isinstance(values, list):
                raise ConfigError(f"step-time profile {path}: {name} must be a list of numbers, got {values!r}")
            return tuple(seconds(name, x) for x in values)

        decode_s = data.get("decode_s", {})
        if not isinstance(decode_s, dict) or not all(rows.isdigit() for rows in decode_s):
            raise ConfigError(f"step-time profile {path}: decode_s must map batch sizes to seconds, got {decode_s!r}")
        source = data.get("source", str(path))
        if not isinstance(source, str):
            raise ConfigError(f"step-time profile {path}: source must be a string, got {source!r}")
        profile = cls(seconds("base_s", data["base_s"]), seconds("per_token_s", data["per_token_s"]), source,
                      series("spread"), series("ingress"), series("delivery"),
                      seconds("per_row_s", data.get("per_row_s", 0.0)),
                      {int(rows): seconds("decode_s", s) for rows, s in decode_s.items()}, series("decode_spread"))
        if profile.base_s + profile.per_token_s + profile.per_row_s == 0:
            raise ConfigError(f"a step-time profile's base_s, per_row_s and per_token_s must be >= 0, not all 0 "
                              f"({path})")
        if any(rows < 1 or s <= 0 for rows, s in profile.decode_s.items()):
            raise ConfigError(f"a step-time profile's decode_s maps batch sizes >= 1 to seconds > 0 ({path})")
        check_spread(profile.spread, str(path))
        check_spread(profile.decode_spread, str(path))
        check_serving_path(profile, str(path))
        return profile


def check_spread(spread: tuple[float, ...], where: str) -> None:
    if spread and (len(spread) != len(SPREAD_QUANTILES) or spread[0] <= 0
                   or any(b < a for a, b in zip(spread, spread[1:]))):
        raise ConfigError(f"a step-time profile's spread must be {len(SPREAD_QUANTILES)} positive, non-decreasing "
                          f"ratios at the quantiles {', '.join(map(str, SPREAD_QUANTILES))} ({where})")


def check_serving_path(profile: StepTimeProfile, where: str) -> None:
    for name, values in (("ingress", profile.ingress), ("delivery", profile.delivery)):
        if values and (len(values) != len(SPREAD_QUANTILES) or values[0] < 0
                       or any(b < a for a, b in zip(values, values[1:]))):
            raise ConfigError(f"a step-time profile's {name} must be {len(SPREAD_QUANTILES)} non-negative, "
                              f"non-decreasing seconds at the quantiles {', '.join(map(str, SPREAD_QUANTILES))} "
                              f"({where})")


def fit(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``(base_s, per_token_s)`` over ``(tokens, seconds)`` samples, both kept >= 0: the live model's
    fit with nothing forgotten."""
    model = StepTimeModel(forget=0.0)
    for tokens, seconds in samples:
        model.observe(tokens, seconds)
    return model.coefficients()


def measure(config: EngineConfig, repeats: int = 3, log=lambda line: None) -> tuple[StepTimeProfile, int]:
    """Time real steps of ``config``'s model here: every decode batch size 1, 2, 4... up to ``max_num_seqs`` and
    prefill chunks of 32 tokens up to the step budget; the median of ``repeats`` timings each, against the tokens
    each timed step really computed. Returns the profile and the engine's KV block count (null block included)."""
    from dataclasses import replace

    from rtxcore.capacity.simulation import count_scheduled_tokens
    from rtxcore.engine.llm import LLM

    # Steps timed one by one: serial (an overlapped step returns before its work is done) and first come, first
    # served (a lane-aware scheduler may hold a step open for newcomers). The step's cost is the model's and the
    # backend's, whichever scheduler fills it.
    # No prefix caching: a timed prompt must not reuse an earlier one's blocks.
    engine = LLM(replace(config, scheduler="fcfs", async_scheduling=False, enable_prefix_caching=False,
                         scheduling=replace(config.scheduling, options={})))
    scheduled = count_scheduled_tokens(engine)
    sched = config.scheduling
    samples: list[tuple[int, float]] = []
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sizes = []
    size = 1
    while size <= sched.max_num_seqs:
        sizes.append(size)
        size *= 2
    for batch in sizes:
        # Prompts of 8 tokens: their prefill is one step, then every step is a decode of `batch` rows.
        def decode_batch(r: int, batch: int = batch) -> None:
            for i in range(batch):
                engine.add_request([1 + (i + r) % 7] * 8 + [i, r], greedy)
            while any(req.num_output_tokens == 0 for req in engine.core.requests.values()):
                engine.step()  # the prefills, untimed
        samples.append(_median_step(engine, decode_batch, repeats, scheduled))
    chunk = 32
    while chunk <= sched.max_num_batched_tokens:
        def prefill(r: int, chunk: int = chunk) -> None:
            engine.add_request([2 + r] * (chunk - 1) + [chunk + r], SamplingParams(max_tokens=1, ignore_eos=True))
        samples.append(_median_step(engine, prefill, repeats, scheduled))
        chunk *= 2
    base, per_token = fit(samples)
    log(f"step-time profile from {len(samples)} step shapes: {base * 1000:.2f} ms + {per_token * 1000:.3f} ms/token")
    blocks = engine.core.kv_cache.pool.num_usable_blocks + 1  # the pool keeps one block back as the null block
    return StepTimeProfile(base, per_token, f"measured here on {config.model or 'the default model'}"), blocks


def _median_step(engine, prepare: Callable[[int], None], repeats: int, scheduled: list[int]) -> tuple[int, float]:
    """(tokens, seconds) of the step after ``prepare(r)``: the median time over ``repeats`` runs (each drained before
    the next) and the tokens the median run's step computed."""
    runs = []
    for r in range(repeats):
        prepare(r)
        started = time.perf_counter()
        engine.step()
        runs.append((time.perf_counter() - started, scheduled[0]))
        while engine.has_unfinished_requests():
            engine.step()
    seconds, tokens = sorted(runs)[len(runs) // 2]
    return tokens, seconds


def from_server(url: str, block_size: int, timeout_s: float = 10.0) -> tuple[StepTimeProfile, int]:
    """The step-time profile a running server's engine learnt from its own steps under load (its spread included),
    and its KV block count, read from its ``/metrics``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s)
        response.raise_for_status()
        samples = [s for family in text_string_to_metric_families(response.text) for s in family.samples]
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:  # unreachable, an error status, not Prometheus
        # httpx's status errors add a second line ("For more information check: ..."): the first says it all.
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"cannot read {url}/metrics: {reason}") from None

    def one(name: str, **labels: str) -> float | None:
        found = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
        return found[0] if found else None
    base, per_token = one("rtx_step_time_profile_seconds", part="base"), one("rtx_step_time_profile_seconds",
                                                                            part="per_token")
    if base is None or per_token is None:
        raise ConfigError(f"{url} exports no learnt step time (rtx_step_time_profile_seconds): it needs some "
                          "minutes of steps under load first")
    def spread(**kind: str) -> tuple[float, ...]:
        ratios = [one("rtx_step_time_spread_ratio", quantile=str(q), **kind) for q in SPREAD_QUANTILES]
        found = tuple(r for r in ratios if r is not None)
        check_spread(found, f"{url}/metrics")
        return found
    # Each kind of step's spread where the server has seen enough of it; servers before kinds were told apart
    # exported one spread without the label, which every step draws from.
    decode_spread = spread(kind=DECODE)
    other_spread = spread(kind=OTHER)
    if not decode_spread and not other_spread:
        other_spread = spread()
    # Absent until some requests came through the servers (and from servers before it was exported): none then.
    paths = {part: tuple(v for q in SPREAD_QUANTILES
                         if (v := one("rtx_serving_path_seconds", part=part, quantile=str(q))) is not None)
             for part in ("ingress", "delivery")}
    capacity = one("rtx_kv_tier_capacity_bytes", tier="device")
    per_token_bytes = one("rtx_kv_bytes_per_token")
    if not capacity or not per_token_bytes:
        raise ConfigError(f"{url} exports no KV cache size (rtx_kv_tier_capacity_bytes)")
    blocks = round(capacity / (per_token_bytes * block_size)) + 1  # the usable blocks, and the null block
    # Servers before the per-row part exported none: tokens alone then.
    per_row = one("rtx_step_time_profile_seconds", part="per_row") or 0.0
    decode = {int(s.labels["rows"]): s.value for s in samples
              if s.name == "rtx_step_time_decode_seconds" and s.labels.get("rows", "").isdigit() and s.value > 0}
    profile = StepTimeProfile(base, per_token, f"learnt by the server at {url}", other_spread, paths["ingress"],
                              paths["delivery"], per_row, decode, decode_spread)
    check_serving_path(profile, f"{url}/metrics")
    return profile, blocks
