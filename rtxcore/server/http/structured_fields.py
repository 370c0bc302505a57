"""The fields of an OpenAI-style body that ask for structured output: OpenAI's ``response_format``, vLLM's
``structured_outputs`` object and vLLM's older ``guided_*`` fields, checked into the one grammar request
:class:`~rtxcore.sampling_params.SamplingParams` takes (``structured_output``)."""

from __future__ import annotations

from typing import Any

from rtxcore.errors import InvalidRequestError
from rtxcore.sampling_params import STRUCTURED_OUTPUT_KINDS
from rtxcore.server.serving.json_schema import closed_objects

# vLLM's older names for structured output, each one kind of SamplingParams.structured_output.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def structured_output_field(body: dict[str, Any]) -> str | None:
    """The body's field that asked for structured output: what an error about the grammar names."""
    for name in ("response_format", "structured_outputs", *_GUIDED_FIELDS):
        if body.get(name) is not None:
            return name
    return None


def structured_output(body: dict[str, Any]) -> dict[str, Any] | None:
    """The one grammar a body asks its output to follow: OpenAI's ``response_format``, vLLM's ``structured_outputs``
    object, or vLLM's ``guided_*`` fields; None for free text."""
    found: list[tuple[str, dict[str, Any]]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    structured = body.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise InvalidRequestError("structured_outputs must be an object", param="structured_outputs")
        given = {k: v for k, v in structured.items() if v is not None and v is not False}
        unknown = sorted(set(given) - set(STRUCTURED_OUTPUT_KINDS))
        if unknown:
            raise InvalidRequestError(f"structured_outputs.{unknown[0]} is not supported (supported: "
                                      f"{', '.join(STRUCTURED_OUTPUT_KINDS)})", param="structured_outputs")
        if not given:  # as vLLM: an object that asks for nothing is a mistake, not free text
            raise InvalidRequestError(f"structured_outputs must name one kind of structured output "
                                      f"({', '.join(STRUCTURED_OUTPUT_KINDS)})", param="structured_outputs")
        found += [("structured_outputs", {k: v}) for k, v in given.items()]
    for name, kind in _GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append((name, {kind: body[name]}))
    if len(found) > 1:
        names = sorted({name for name, _ in found})
        raise InvalidRequestError(f"only one structured output may be asked for; got {' and '.join(names)}"
                                  if len(names) > 1 else f"{names[0]} must name one kind of structured output",
                                  param=found[1][0])
    return found[0][1] if found else None


def _response_format(value: Any) -> dict[str, Any] | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        return json_schema_format(value.get("json_schema"), "response_format.json_schema", "response_format")
    raise InvalidRequestError("response_format.type must be 'text', 'json_object' or 'json_schema'",
                              param="response_format")


def json_schema_format(spec: Any, where: str, param: str) -> dict[str, Any]:
    """A JSON-schema format, ``{"name", "schema", "strict"}``, as the grammar request it makes; ``where`` is its
    place in the body for messages (chat's ``response_format.json_schema``, the Responses API's ``text.format``)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InvalidRequestError(f"{where} must be an object with a 'name' and a 'schema'", param=param)
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{where}.schema must be a JSON Schema object", param=param)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"{where}.strict must be true or false, got {strict!r}", param=param)
    # OpenAI's strict mode: an object takes only the properties it lists (the grammar engine, like JSON Schema,
    # otherwise allows others).
    return {"json": closed_objects(schema) if strict else schema}
