"""How a user's bad value is named in an error message, for every layer that checks user input (HTTP bodies,
chat messages, prompt files): a leaf module, so the tokenization layer needs nothing from the HTTP front end.
"""

from __future__ import annotations

import json
from typing import Any


def json_kind(v: Any) -> str:
    """The value as JSON (cut at 60 characters) and its type, e.g. ``"abc" (str)``, ``null (NoneType)``."""
    text = json.dumps(v) if isinstance(v, (dict, list, str, int, float, bool)) or v is None else repr(v)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({'null' if v is None else type(v).__name__})"
