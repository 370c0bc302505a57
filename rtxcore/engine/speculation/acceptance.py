"""How many tokens each request proposes, from what it has had accepted (dynamic acceptance)."""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the newest verification in a request's smoothed acceptance rate.
_RATE_WEIGHT = 0.3
# Verifications before a low rate may stop a request's speculation (the first ones say little).
_MIN_VERIFICATIONS = 4
# Plain tokens a request decodes after its acceptance fell too low, before it tries again (doubled each time).
_FIRST_PAUSE_TOKENS = 32


@dataclass(slots=True)
class _State:
    k: int
    rate: float = 1.0
    num_verifications: int = 0
    # Tokens to decode plainly before proposing again, and the pause the next fallback gets.
    paused_for: int = 0
    next_pause: int = _FIRST_PAUSE_TOKENS


class AcceptanceTracker:
    """Per request: k grows by one after a fully accepted proposal and shrinks to one past what was accepted
    otherwise, so it follows the length of the runs the target agrees with; a request whose smoothed acceptance
    rate drifts below ``min_acceptance`` stops speculating (plain decoding) for a pause that doubles each time."""

    def __init__(self, max_k: int, min_acceptance: float, adaptive: bool = True):
        self.max_k = max_k
        self.min_acceptance = min_acceptance
        self.adaptive = adaptive
        self._states: dict[str, _State] = {}

    def k(self, req_id: str) -> int:
        """Tokens to propose for the request now (0 while it decodes plainly)."""
        state = self._states.get(req_id)
        if state is None:
            return self.max_k
        if state.paused_for > 0:
            state.paused_for -= 1
            return 0
        return state.k

    def record(self, req_id: str, num_proposed: int, num_accepted: int) -> bool:
        """Count one verification; returns True when it stops the request's speculation for a pause."""
        state = self._states.get(req_id)
        if state is None:
            state = self._states[req_id] = _State(self.max_k)
        state.num_verifications += 1
        state.rate += _RATE_WEIGHT * (num_accepted / num_proposed - state.rate)
        if self.adaptive:
            state.k = min(state.k + 1, self.max_k) if num_accepted == num_proposed else max(1, num_accepted + 1)
        if state.num_verifications >= _MIN_VERIFICATIONS and state.rate < self.min_acceptance:
            state.paused_for, state.next_pause = state.next_pause, 2 * state.next_pause
            state.rate, state.num_verifications = 1.0, 0
            state.k = 1 if self.adaptive else self.max_k  # probe again from one token
            return True
        return False

    def forget(self, req_id: str) -> None:
        self._states.pop(req_id, None)
