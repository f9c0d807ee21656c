"""`tandem backend restart NAME`: restart a backend of a running `tandem serve` (or GUI server)."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import aiohttp


def run_backend(args) -> int:
    return asyncio.run(_restart(args.url.rstrip("/"), args.name, args.api_key or os.environ.get("TANDEM_API_KEY")))


async def _restart(url: str, name: str, api_key: str | None) -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session,
                    session.post(f"{url}/v1/backends/{name}/restart", headers=headers) as r):
            body = await r.json(content_type=None)
    except aiohttp.ClientError as e:
        print(f"tandem: cannot reach the server at {url}: {e}", file=sys.stderr)
        return 2
    if r.status != 200:
        print(f"tandem: {body.get('error', {}).get('message', body)}", file=sys.stderr)
        return 1
    print(json.dumps({"backend": body["name"], "healthy": body["healthy"], "device": body["device"]}))
    return 0
