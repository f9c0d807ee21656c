"""A local server that speaks the parts of the Hugging Face Hub's API that `huggingface_hub` calls
for search, listing and download, for tests with no internet (`HF_ENDPOINT` points at it):

- `GET /api/models?search=&filter=&sort=&limit=`            HfApi.list_models
- `GET /api/models/{owner}/{name}/tree/{revision}[/{path}]`  HfApi.list_repo_tree (`?recursive=`)
- `GET /api/models/{owner}/{name}/revision/{revision}`       HfApi.model_info / repo_info
- `HEAD|GET /{owner}/{name}/resolve/{revision}/{path}`       hf_hub_download, HfFileSystem reads:
  `X-Repo-Commit`, `ETag` / `X-Linked-Etag` (the sha256 for LFS files), `X-Linked-Size`,
  `Content-Length`, byte ranges (`Range: bytes=N-` / `N-M` answered 206 with `Content-Range`).

Files are real bytes served from memory. `cut_after` makes a GET end the connection after that
many bytes (a download cut half way); `stall_after` makes a GET hold still after that many bytes
(`stalled` is set) until `release` is set, so a test can stop or kill a download at a known byte;
`requests` records every request (method, path, Range) and `served` the body bytes each GET handed
to its connection (by path and Range header; counted before each write, so a test that has read
a whole body finds it all counted).
Runs aiohttp on its own thread and loop; `close()` stops it. `split_gguf` cuts a GGUF into parts
the way llama.cpp's gguf-split names and marks them (`split.no`, `split.count`), for models in parts.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import threading
from pathlib import Path

from aiohttp import web

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}  # repo id -> {path: bytes}
        self.downloads: dict[str, int] = {}
        self.requests: list[tuple[str, str, str]] = []
        self.cut_after: int | None = None  # end a GET's body after this many bytes (once)
        self.corrupt: set[str] = set()  # paths served with one byte flipped (a bad checksum)
        self.stall_after: int | None = None  # hold a GET after this many body bytes (once) until `release`
        self.stalled = threading.Event()
        self.release = threading.Event()
        self.served: dict[tuple[str, str], int] = {}  # (path, Range header) -> body bytes sent
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-hub", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the fake Hub did not start")

    def add(self, repo_id: str, files: dict[str, bytes], downloads: int = 0) -> None:
        self.repos[repo_id] = dict(files)
        self.downloads[repo_id] = downloads

    @staticmethod
    def sha256(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    # ---- server ----

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/api/models", self._list_models)
        app.router.add_get(r"/api/models/{owner}/{name}/tree/{rest:.*}", self._tree)
        app.router.add_get(r"/api/models/{owner}/{name}/revision/{revision}", self._info)
        app.router.add_route("*", r"/{owner}/{name}/resolve/{revision}/{path:.*}", self._resolve)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def stop():
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    def _log(self, request: web.Request) -> None:
        self.requests.append((request.method, request.path, request.headers.get("Range", "")))

    async def _list_models(self, request: web.Request) -> web.Response:
        self._log(request)
        q = (request.query.get("search") or "").lower()
        limit = int(request.query.get("limit") or 1000)
        found = [r for r in self.repos if q in r.lower()]
        if request.query.get("filter") == "gguf":
            found = [r for r in found if any(p.endswith(".gguf") for p in self.repos[r])]
        found.sort(key=lambda r: -self.downloads[r])
        return web.json_response([{"id": r, "_id": r, "modelId": r, "downloads": self.downloads[r], "likes": 1,
                                   "tags": ["gguf"], "private": False} for r in found[:limit]])

    def _entry(self, path: str, data: bytes) -> dict:
        sha = self.sha256(data)
        return {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": path,
                "lfs": {"oid": sha, "size": len(data), "pointerSize": 134}}

    async def _tree(self, request: web.Request) -> web.Response:
        self._log(request)
        repo = f"{request.match_info['owner']}/{request.match_info['name']}"
        if repo not in self.repos:
            return web.json_response({"error": "Repository not found"}, status=404,
                                     headers={"X-Error-Code": "RepoNotFound"})
        rest = request.match_info["rest"]
        _revision, _, folder = rest.partition("/")
        recursive = request.query.get("recursive", "false").lower() in ("true", "1")
        out, dirs = [], set()
        for path, data in sorted(self.repos[repo].items()):
            if folder and not path.startswith(folder.rstrip("/") + "/"):
                continue
            inner = path[len(folder.rstrip("/")) + 1:] if folder else path
            if "/" in inner and not recursive:
                dirs.add((folder.rstrip("/") + "/" if folder else "") + inner.split("/", 1)[0])
                continue
            out.append(self._entry(path, data))
        out = [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in sorted(dirs)] + out
        return web.json_response(out)

    async def _info(self, request: web.Request) -> web.Response:
        self._log(request)
        repo = f"{request.match_info['owner']}/{request.match_info['name']}"
        if repo not in self.repos:
            return web.json_response({"error": "Repository not found"}, status=404)
        return web.json_response({"id": repo, "_id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                  "siblings": [{"rfilename": p} for p in self.repos[repo]], "tags": ["gguf"]})

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        self._log(request)
        repo = f"{request.match_info['owner']}/{request.match_info['name']}"
        path = request.match_info["path"]
        data = self.repos.get(repo, {}).get(path)
        if data is None:
            return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound"})
        sha = self.sha256(data)
        if path in self.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"',
                   "X-Linked-Size": str(len(data)), "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        start, end = 0, len(data) - 1
        status = 200
        rng = request.headers.get("Range", "")
        if rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start = int(a) if a else 0
            end = min(int(b), len(data) - 1) if b else len(data) - 1
            if start >= len(data):
                return web.Response(status=416, headers={"Content-Range": f"bytes */{len(data)}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        body = data[start:end + 1]
        headers["Content-Length"] = str(len(body))
        if request.method == "HEAD":
            return web.Response(status=status, headers=headers)
        resp = web.StreamResponse(status=status, headers=headers)
        await resp.prepare(request)
        cut = self.cut_after
        if cut is not None and request.method == "GET":
            self.cut_after = None
            await self._send(resp, (path, rng), body[:cut])
            request.transport.close()  # the connection drops half way
            return resp
        stall = self.stall_after
        if stall is not None:
            self.stall_after = None
            await self._send(resp, (path, rng), body[:stall])
            self.stalled.set()
            await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 120)
            body = body[stall:]
        await self._send(resp, (path, rng), body)
        try:
            await resp.write_eof()
        except ConnectionError:  # the client went away (a killed download)
            pass
        return resp

    async def _send(self, resp: web.StreamResponse, key: tuple[str, str], body: bytes) -> None:
        for i in range(0, len(body), 64 << 10):
            chunk = body[i:i + (64 << 10)]
            # Counted before it is written: a client that has read the bytes finds them counted.
            self.served[key] = self.served.get(key, 0) + len(chunk)
            await resp.write(chunk)


def split_gguf(src: Path, folder: Path, parts: int) -> list[Path]:
    """Write the GGUF at `src` again as `parts` files in `folder` (`<stem>-0000i-of-0000N.gguf`:
    the metadata in the first, the tensors spread over all), with gguf's own writer."""
    import gguf  # numpy: after llama.cpp (the test modules import ui_fixtures first)

    reader = gguf.GGUFReader(str(src), "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(None, arch, split_max_tensors=math.ceil(len(reader.tensors) / parts))
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file(Path(folder) / Path(src).name)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = sorted(Path(folder).glob(f"{Path(src).stem}-*-of-*.gguf"))
    assert len(out) == parts, out
    return out
