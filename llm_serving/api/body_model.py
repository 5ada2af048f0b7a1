"""The base of the HTTP bodies declared as pydantic models, and pydantic's errors as the API's 400s.

Why pydantic: each field's type, range and default is declared once, next to its name (as vLLM's OpenAI protocol
does), instead of read by hand key by key. Why our own messages: the API's errors name one parameter, quote the
value (shortened) and say the bound, as they did before the models; clients and tests read them. So a field check
that pydantic cannot express raises ``refuse`` (a message template with ``{field}`` where the dotted name goes), and
``validate_body`` turns the first error into an ``ApiError``.

The bodies are strict JSON (no "0.8" for a number, no 1 for a boolean; an integer is a number), null means absent
(the field's default), unknown keys are refused (a misspelt key silently ignored would be a wrong answer).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticCustomError

from llm_serving.core.sequence import SAMPLING_RANGES
from llm_serving.describe import json_kind
from llm_serving.request_errors import ApiError

INT64_MAX = 2**63 - 1  # the engine's integers (seeds, token counts) travel as int64
Int64 = Annotated[int, Field(le=INT64_MAX)]
NonNegInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]

_ERROR = "api_error"  # the type of ``refuse``'s errors


class Body(BaseModel):
    """A JSON object of a request body: strict types, null as absent, unknown keys refused, frozen once read."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


def in_range(name: str, hi: float | None = None) -> Any:
    """The bounds of sampling parameter ``name`` (``core.sequence.SAMPLING_RANGES``, the one definition the engine
    checks too), as ``Annotated`` metadata; ``hi`` narrows the upper one (OpenAI's temperature: at most 2)."""
    r = SAMPLING_RANGES[name]
    upper = r.hi if hi is None else hi
    return Field(gt=r.lo if r.lo_open else None, ge=None if r.lo_open else r.lo, le=upper)


def refuse(template: str, param: str | None = None, unsupported: bool = False) -> PydanticCustomError:
    """A validator's error: ``template`` names the field as ``{field}`` (filled in with its dotted name); ``param``
    overrides the parameter named (a model validator's error has no field of its own)."""
    return PydanticCustomError(_ERROR, "{template}", {"template": template, "param": param,
                                                      "kind": "unsupported" if unsupported else "invalid_request"})


ModelT = TypeVar("ModelT", bound=Body)


def validate_body(model: type[ModelT], body: Any, what: str = "the request body") -> ModelT:
    """``body`` (decoded JSON) as ``model``, or the ``ApiError`` of its first problem (unknown keys first, as a
    misspelt key explains the errors that follow from it)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        extra = [e for e in errors if e["type"] == "extra_forbidden"]
        if extra:
            where = extra[0]["loc"][:-1]
            unknown = [str(e["loc"][-1]) for e in extra if e["loc"][:-1] == where]
            raise unknown_keys_error(unknown, _known_keys(model, where), _object_name(where, what)) from None
        raise _api_error(errors[0], what) from None


def unknown_keys_error(unknown: list[str], known: Iterable[str], what: str) -> ApiError:
    """A 400 naming the first unknown key (keys and their number shown bounded: a body may carry thousands)."""
    shown = ", ".join(repr(k[:40]) for k in unknown[:5])
    if len(unknown) > 5:
        shown += f" and {len(unknown) - 5} more"
    return ApiError(400, f"{what} has unknown key(s) {shown}; known keys: {', '.join(known)}", "invalid_request",
                    unknown[0][:40])


def _api_error(error: ErrorDetails, what: str) -> ApiError:
    loc = [str(part) for part in error["loc"]]
    name = ".".join(loc)
    ctx = error.get("ctx") or {}
    value = error["input"]
    kind, param = "invalid_request", loc[-1] if loc else None
    t = error["type"]
    if t == _ERROR:
        message = ctx["template"].replace("{field}", name)
        kind, param = ctx["kind"], ctx["param"] or param
    elif t in ("model_type", "dict_type"):
        message = f"{_object_name(error['loc'], what)} must be a JSON object, got {json_kind(value)}"
    elif t == "missing":
        message = f"missing '{name}'"
    elif t in _TYPES:
        message = f"{name} must be {_TYPES[t]}, got {json_kind(value)}"
    elif t == "string_too_long":
        message = f"{name} has {len(value)} characters; at most {ctx['max_length']}"
    elif t in _BOUNDS:
        op, key = _BOUNDS[t]
        bound = ctx[key]
        message = (f"{name} is too large: {value}" if bound == INT64_MAX else
                   f"{name} must be {op} {_number(bound)}, got {_number(value)}")
    else:  # a shape no field of ours declares; pydantic's own words then
        message = f"{name or what}: {error['msg']}, got {json_kind(value)}"
    return ApiError(400, message, kind, param)


_TYPES = {"bool_type": "a boolean (true/false)", "int_type": "an integer", "float_type": "a finite number",
          "finite_number": "a finite number", "string_type": "a string"}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
           "less_than": ("<", "lt")}


def _object_name(loc: tuple[int | str, ...], what: str) -> str:
    return f"'{'.'.join(str(p) for p in loc)}'" if loc else what


def _known_keys(model: type[Body], loc: tuple[int | str, ...]) -> list[str]:
    """The keys the object at ``loc`` may have (its model's fields, by the names they are sent under)."""
    for part in loc:
        annotation = _keys(model)[str(part)].annotation
        nested = [a for a in getattr(annotation, "__args__", (annotation,))
                  if isinstance(a, type) and issubclass(a, Body)]
        if not nested:
            return []
        model = nested[0]
    return list(_keys(model))


def _keys(model: type[Body]) -> dict[str, FieldInfo]:
    return {info.alias or name: info for name, info in model.model_fields.items()}


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
