"""Structured-output keys of the OpenAI routes, as OpenAI and vLLM name them, parsed into one ``OutputConstraint``.

OpenAI's ``response_format`` (``json_object``: any JSON object; ``json_schema``: ``{"name", "schema", "strict"}``),
vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` and its current ``structured_outputs``
(``{"json" | "regex" | "choice": ...}``). At most one per request. Whether a schema or regex compiles is the
engine's to say (``core.grammar``), as a 400 naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llm_serving.api.errors import invalid, unsupported
from llm_serving.core.sequence import OutputConstraint
from llm_serving.describe import json_kind

STRUCTURED_KEYS = ("response_format", "guided_json", "guided_regex", "guided_choice", "structured_outputs")
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or choice list as JSON text
_ANY_OBJECT = json.dumps({"type": "object"})


def parse_constraint(body: Mapping[str, Any]) -> OutputConstraint | None:
    """The request's output constraint, None without one; a 400 naming the key for a malformed one."""
    found = [c for c in (_response_format(body.get("response_format")), *_guided(body)) if c is not None]
    if len(found) > 1:
        raise invalid(f"{' and '.join(c.field for c in found)} both constrain the answer; send one of them",
                      found[1].field)
    if found and len(found[0].spec) > MAX_SPEC_CHARS:
        raise invalid(f"{found[0].field} is {len(found[0].spec)} characters as JSON; at most {MAX_SPEC_CHARS}",
                      found[0].field)
    return found[0] if found else None


def _response_format(fmt: Any) -> OutputConstraint | None:
    key = "response_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise invalid(f"{key} must be an object with a 'type' (text, json_object, json_schema), got {json_kind(fmt)}",
                      key)
    kind = fmt["type"]
    extra = set(fmt) - {"type", "json_schema"}
    if extra:
        raise invalid(f"{key} has unknown key(s) {sorted(extra)}", key)
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint("json", _ANY_OBJECT, key)
    if kind != "json_schema":
        raise unsupported(f"{key} type {kind!r} is not supported; use text, json_object or json_schema", key)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise invalid(f"{key}.json_schema must be an object {{\"name\", \"schema\", \"strict\"}} with the schema an "
                      f"object, got {json_kind(spec)}", key)
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise invalid(f"{key}.json_schema has unknown key(s) {sorted(unknown)}", key)
    if "schema" not in spec:
        raise invalid(f"{key}.json_schema needs its 'schema'", key)
    return OutputConstraint("json", json.dumps(spec["schema"]), key)


def _guided(body: Mapping[str, Any]) -> list[OutputConstraint | None]:
    """vLLM's keys: the ``guided_*`` ones and the entries of ``structured_outputs``."""
    nested = body.get("structured_outputs")
    if nested is not None and not isinstance(nested, dict):
        raise invalid(f"structured_outputs must be an object, got {json_kind(nested)}", "structured_outputs")
    nested = nested or {}
    unknown = set(nested) - {"json", "regex", "choice"}
    if unknown:
        raise unsupported(f"structured_outputs supports json, regex and choice; got {sorted(unknown)}",
                          "structured_outputs")
    out = [_one(kind, body.get(f"guided_{kind}"), f"guided_{kind}") for kind in ("json", "regex", "choice")]
    out += [_one(kind, nested.get(kind), f"structured_outputs.{kind}") for kind in ("json", "regex", "choice")]
    return out


def _one(kind: str, value: Any, key: str) -> OutputConstraint | None:
    if value is None:
        return None
    if kind == "json":
        if isinstance(value, str):  # vLLM takes the schema as an object or as JSON text
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise invalid(f"{key} is not valid JSON: {exc}", key) from None
        if not isinstance(value, dict):
            raise invalid(f"{key} must be a JSON schema (an object), got {json_kind(value)}", key)
        return OutputConstraint("json", json.dumps(value), key)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise invalid(f"{key} must be a non-empty string (a regular expression), got {json_kind(value)}", key)
        return OutputConstraint("regex", value, key)
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise invalid(f"{key} must be a non-empty list of non-empty strings, got {json_kind(value)}", key)
    return OutputConstraint("choice", json.dumps(value, ensure_ascii=False), key)
