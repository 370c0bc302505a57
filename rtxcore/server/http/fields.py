"""Checks of one request field of a JSON body, shared by every body parser of the HTTP API: each returns the value
when it has the right type (and range), else raises :class:`InvalidRequestError` naming the field (a 400 with
``param``)."""

from __future__ import annotations

from typing import Any

from rtxcore.errors import InvalidRequestError
from rtxcore.sampling_params import is_int


def model_field(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError("model must be a string", param="model")
    return model


def int_field(value: Any, param: str, low: int | None = None, high: int | None = None) -> int:
    if not is_int(value):
        raise InvalidRequestError(f"{param} must be an integer, got {value!r}", param=param)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidRequestError(f"{param} must be {bounds}, got {value}", param=param)
    return value


def bool_field(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{param} must be true or false", param=param)
    return value


def flag_field(body: dict[str, Any], name: str) -> bool:
    """An optional true/false field, null or absent meaning false (any other type refused, 0 and "" included)."""
    value = body.get(name)
    return False if value is None else bool_field(value, name)
