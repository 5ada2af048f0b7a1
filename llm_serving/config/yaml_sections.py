"""Reading llm-serving YAML into configuration sections: unknown keys with a suggestion, type checks and
coercion per declared kind, relative paths, and the llm-serving keys that are accepted but mean nothing here.

A section is a frozen dataclass whose fields are declared with ``setting(default, kind)``; the kind (see
``KIND_TEXT``) says how a YAML value is checked and converted. Every mistake is a ``ConfigError`` naming
the file and the key. Kept free of MindSpore.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llm_serving.protocol.model_config import DTYPES

KIND_TEXT = {
    "int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean (true/false)",
    "path": "a path string", "ints": "a list of integers", "buckets": "a list of integers",
    "strs": "a list of strings", "switch_or_path": "true, false or a directory path",
    "int_or_auto": "an integer or auto",
    "named_paths": "a mapping of NAME: DIR or a list of NAME=DIR strings",
}


class ConfigError(ValueError):
    """A launch configuration that cannot be served; the message names the file and the key."""

    def __init__(self, message: str, key: str | None = None, source: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.source = source


def setting(default: Any, kind: str, optional: bool = False) -> Any:
    """A section field; ``kind`` drives parsing (see ``coerce``), ``optional`` lets it be None."""
    return dataclasses.field(default=default, metadata={"kind": kind, "optional": optional})


# llm-serving keys with no meaning here: accepted (type-checked) and ignored, with a note.
COMPAT_KEYS: dict[str, dict[str, str]] = {
    "model_config": {
        "zactivate_len": "ints", "model_type": "str", "seq_type": "str", "batch_waiting_time": "float",
        "decode_batch_waiting_time": "float", "batching_strategy": "str", "current_index": "bool",
        "model_dtype": "str",
    },
    "serving_config": {
        "agent_ip": "str", "prefill_batch_waiting_time": "float", "decode_batch_waiting_time": "float",
        "enable_host_post_sampling": "bool",
    },
}
COMPAT_SECTIONS = {
    "model_path": "llm-serving MindIR graph paths are not used; set model_config.model_path",
    "basic_inputs": "input builders are fixed for Llama",
    "extra_inputs": "input builders are fixed for Llama",
    "warmup_inputs": "warm-up covers every bucket",
}


# ----- parsing --------------------------------------------------------------------------------------------
def parse_section(name: str, cls: type, body: Any, source: str, base: Path, notes: list[str]) -> Any:
    """Section ``name`` (dataclass ``cls``) from its YAML ``body``; ignored compatibility keys go to ``notes``."""
    if body is None:
        return cls()
    if not isinstance(body, Mapping):
        raise ConfigError(f"{source}: section {name!r} must be a mapping of keys, got {show_value(body)}",
                          key=name, source=source)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    compat = COMPAT_KEYS.get(name, {})
    values: dict[str, Any] = {}
    ignored: list[str] = []
    for key, value in body.items():
        dotted = f"{name}.{key}"
        if key in fields:
            meta = fields[key].metadata
            parsed = coerce(value, meta["kind"], dotted, source, base)
            if parsed is not None or meta["optional"]:
                values[key] = parsed
        elif key in compat:
            parsed = coerce(value, compat[key], dotted, source, base)
            if key == "model_dtype" and parsed is not None:
                dtype = parsed.lower().removeprefix("datatype.")
                if dtype not in DTYPES:
                    raise bad_value(source, dotted, f"expected DataType.FLOAT32/FLOAT16/BFLOAT16, got {parsed!r}")
                if body.get("dtype") is None:
                    values["dtype"] = dtype
                    continue
            ignored.append(str(key))
        else:
            known = [*fields, *compat]
            raise ConfigError(f"{source}: unknown key {key!r} in section {name!r}{suggest(key, known)}; "
                              f"known keys: {', '.join(known)}", key=dotted, source=source)
    if ignored:
        notes.append(f"{name}: {', '.join(ignored)} accepted for llm-serving compatibility and ignored")
    if name == "model_config" and values.get("page_attention") is False:
        notes.append("model_config.page_attention: False ignored; the KV cache is always paged")
    return cls(**values)


def coerce(value: Any, kind: str, key: str, source: str, base: Path) -> Any:
    """Check one value against its kind; returns None for null (and for an empty path)."""
    if value is None:
        return None
    ok = True
    if kind == "int_or_auto" and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if kind in ("int", "int_or_auto"):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind == "bool":
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            value = value.strip().lower() == "true"
        ok = isinstance(value, bool)
    elif kind == "switch_or_path":  # true/false, or a path (which means true, there)
        if isinstance(value, bool) or (isinstance(value, str) and value.strip().lower() in ("true", "false")):
            return coerce(value, "bool", key, source, base)
        ok = isinstance(value, str) and bool(value.strip())
        if ok:
            value = os.path.normpath(base / os.path.expanduser(value.strip()))
    elif kind in ("str", "path"):
        ok = isinstance(value, str)
        if ok and kind == "path":
            if not value.strip():
                return None
            value = os.path.normpath(base / os.path.expanduser(value.strip()))
    elif kind == "named_paths":  # NAME: DIR or [NAME=DIR, ...] -> ("NAME=/abs/DIR", ...)
        if isinstance(value, Mapping):
            value = [f"{k}={v}" for k, v in value.items()] if all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()) else None
        ok = isinstance(value, (list, tuple)) and all(isinstance(x, str) and "=" in x for x in value)
        if ok:
            value = tuple(f"{n.strip()}={os.path.normpath(base / os.path.expanduser(p.strip()))}" if p.strip()
                          else f"{n.strip()}=" for n, _, p in (x.partition("=") for x in value))
    elif kind in ("ints", "buckets", "strs"):
        item_ok = (lambda x: isinstance(x, str)) if kind == "strs" else (
            lambda x: isinstance(x, int) and not isinstance(x, bool))
        ok = isinstance(value, (list, tuple)) and all(item_ok(x) for x in value)
        if ok:
            value = tuple(sorted(set(value))) if kind == "buckets" else tuple(value)
    if not ok:
        raise bad_value(source, key, f"expected {KIND_TEXT[kind]}, got {show_value(value)}")
    return value


def bad_value(source: str, key: str, msg: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {msg}", key=key, source=source)


def need(ok: bool, source: str, key: str, msg: str) -> None:
    """A check of a section's validation: ``bad_value(source, key, msg)`` is raised unless ``ok``."""
    if not ok:
        raise bad_value(source, key, msg)


def show_value(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def suggest(name: Any, known: Any) -> str:
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
