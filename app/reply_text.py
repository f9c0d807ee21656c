"""The text of a reply in llama-server's generic format (engine/prompts/structured.py) cut
short, as a stream or a `length` finish leaves it: what the chat and Responses routes show."""

from __future__ import annotations

import json

from pydantic_core import from_json


def cut_response(text: str) -> str | None:
    """The text of a generic-format reply cut short: `{"response": "Hel` gives `Hel`; a cut
    `tool_call` (or anything else) gives None."""
    try:
        obj = from_json(text, allow_partial="trailing-strings")
    except ValueError:
        return None
    response = obj.get("response") if isinstance(obj, dict) else None
    if response is None:
        return None
    return response if isinstance(response, str) else json.dumps(response, ensure_ascii=False)
