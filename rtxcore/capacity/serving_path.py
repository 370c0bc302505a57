"""What a request spends outside the engine before its first token reaches its client, learnt from live requests:
the queueing model's engine starts the clock at submission, a client at its send.

Two parts per request, on the server's monotonic clock:

- ``ingress``: from the HTTP request's arrival (or the gRPC call's) to its submission to the engine: parsing,
  validation, the chat template and tokenizer, tenant admission, and the event loop's turns between them (on a busy
  host, waiting for the engine's thread to let go of the interpreter).
- ``delivery``: from the engine sampling the first token to the event loop receiving it: the hop from the engine's
  thread to the loop and the loop's own queue.

Turning it into an event, the socket write and the client's own reading come after and are not in either. The
last ``PATH_KEPT`` requests' figures give quantiles (at step_time.SPREAD_QUANTILES) the simulation draws from.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rtxcore.capacity.step_time import sample_quantiles

PATH_KEPT = 1000
PATH_MIN_SAMPLES = 20
PARTS = ("ingress", "delivery")


@dataclass(slots=True)
class ServingPathRecorder:
    ingress: deque[float] = field(default_factory=lambda: deque(maxlen=PATH_KEPT))
    delivery: deque[float] = field(default_factory=lambda: deque(maxlen=PATH_KEPT))

    def observe(self, ingress_s: float, delivery_s: float) -> None:
        # Clocks read on two threads can disagree by a hair: a negative figure is 0.
        self.ingress.append(max(ingress_s, 0.0))
        self.delivery.append(max(delivery_s, 0.0))

    @property
    def ready(self) -> bool:
        return len(self.ingress) >= PATH_MIN_SAMPLES

    def quantiles(self, part: str) -> tuple[float, ...]:
        return sample_quantiles(self.ingress if part == "ingress" else self.delivery)
