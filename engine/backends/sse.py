"""Reading an OpenAI-style server-sent event stream: `data: {json}` lines ending with
`data: [DONE]` (what `tandem serve`, llama-server, vLLM and SGLang send when `stream: true`).

Pure: it reads any async iterable of byte lines (aiohttp's `response.content`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator

DONE = None  # what `data_events` yields for `data: [DONE]`, just before it stops


async def data_events(lines: AsyncIterable[bytes]) -> AsyncIterator[dict | None]:
    """Each `data:` line's JSON object in order, then `DONE` if the stream said `[DONE]`.
    Other lines (comments, `event:`, blank keep-alives) are skipped; bad JSON raises
    `ValueError`."""
    async for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            yield DONE
            return
        yield json.loads(payload)
