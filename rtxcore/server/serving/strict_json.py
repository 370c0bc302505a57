"""JSON as RFC 8259 has it, for what clients send: Python's json module also reads NaN, Infinity and -Infinity,
which a request could then carry into answers no JSON client can read (Starlette's JSONResponse refuses to write
them, and a grammar engine would be handed a schema that is not JSON)."""

from __future__ import annotations

import json
from typing import Any


class NotJSONNumber(ValueError):
    """The text holds NaN, Infinity or -Infinity; ``args[0]`` is which."""


def _refuse(name: str) -> Any:
    raise NotJSONNumber(name)


def loads(text: str) -> Any:
    """:raises NotJSONNumber: the text holds NaN, Infinity or -Infinity.
    :raises json.JSONDecodeError: it is not JSON.
    :raises RecursionError: it is nested deeper than Python's parser goes."""
    return json.loads(text, parse_constant=_refuse)
