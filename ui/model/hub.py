"""Getting a GGUF model from the Hugging Face Hub: search, sizes, whether it fits, download.

Everything goes through `huggingface_hub` (which honours `HF_ENDPOINT`, so tests point it at a
local server that speaks the Hub's API; `HF_TOKEN` for gated models):
- `search_models(query)`: `HfApi.list_models(search=…, filter="gguf")`, most downloaded first;
- `gguf_files(repo)`: `HfApi.list_repo_tree(recursive=True)`, the `.gguf` models with their size
  and LFS sha256; a model in parts (`name-00001-of-00003.gguf`, llama.cpp's gguf-split) is one
  entry whose size is the parts' total, offered only when every part is there (vision
  projectors are left out);
- `model_shape(file)`: reads the file's GGUF header (the first few MiB: one ranged GET of
  `hf_hub_url` on huggingface_hub's HTTP session, with its headers) for the layer and KV-head
  counts, so `fits()` can price the KV cache at the chosen context: weights + KV + a margin
  against this machine's RAM (and a GPU's memory);
- `download(file, folder)`: every part, each through huggingface_hub's own `http_get` into a
  partial file kept beside the model (`.incomplete/`); the next download of the same file, after
  a Stop, a failure or the app closed, asks only for the rest (`http_get(resume_size=…)`: a
  `Range` request, and within one call a dropped connection is resumed the same way).
  `hf_hub_download` is not used for the bytes: huggingface_hub 2.x writes to a process-unique
  temporary file and deletes it on any failure, so nothing survives a stop. Progress goes
  through its `tqdm_class`; each part's sha256 must match the Hub's (else the partial file is
  deleted and the download fails) before it takes its name. Returns the first part, which is
  what llama.cpp is given (it finds the other parts beside it).

Qt-free (the Get model dialog drives it on a worker thread): plain functions, any thread; a
download is stopped by setting the `threading.Event` it was given.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HEADER_BYTES = 8 << 20  # a GGUF header (with a 150k-token vocabulary) fits in a few MiB
HTTP_TIMEOUT_S = 30
REACH_TIMEOUT_S = 5  # the Hub's address must answer within this before a listing is asked for
OVERHEAD = 1.10  # compute buffers and the runtime beside weights + KV
SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)  # llama.cpp's gguf-split names
PARTIAL_DIR = ".incomplete"  # in a repository's download folder: the bytes of unfinished downloads
QUANT = re.compile(r"(?i)[-_.](I?Q\d(?:_[A-Z0-9]+)*|F16|BF16|F32)(?=\.gguf$|[-_.])")

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


class HubError(Exception):
    """A search, listing or download that failed, said for people."""


class DownloadCancelled(HubError):
    pass


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    downloads: int = 0
    likes: int = 0


@dataclass(frozen=True)
class HubFile:
    """A model to download: one file, or a model in parts (`parts`: each part, in order; `path`
    is then the first part's, `size` their total and `sha256` None: each part has its own)."""

    repo_id: str
    path: str
    size: int
    sha256: str | None = None  # the LFS object id; None if the Hub gave none
    parts: tuple[HubFile, ...] = ()

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def files(self) -> tuple[HubFile, ...]:
        """What to download: the parts, or this one file."""
        return self.parts or (self,)

    @property
    def label(self) -> str:
        """The path as people read it: `dir/name-Q4_K_M (3 parts)` for a model in parts."""
        if not self.parts:
            return self.path
        return f"{SPLIT.sub('', self.path)} ({len(self.parts)} parts)"

    @property
    def quant(self) -> str:
        m = QUANT.search(self.name)
        return m.group(1).upper() if m else ""


@dataclass(frozen=True)
class Shape:
    """What the KV cache's size depends on, from a GGUF header."""

    architecture: str
    n_layers: int
    n_kv_heads: int
    key_length: int
    value_length: int
    n_ctx_train: int = 0

    def kv_bytes(self, n_ctx: int, bytes_per_value: int = 2) -> int:
        """The f16 KV cache of one sequence space of `n_ctx` cells."""
        return n_ctx * self.n_layers * self.n_kv_heads * (self.key_length + self.value_length) * bytes_per_value


@dataclass(frozen=True)
class Memory:
    ram_total: int
    ram_available: int
    vram_total: int = 0  # 0: no GPU this app can use


@dataclass(frozen=True)
class Fit:
    need: int  # bytes: weights + KV + margin
    kv: int | None  # None: the header could not be read, KV not priced
    ram: str  # "fits", "tight" (only with other programs' memory freed), "too big"
    vram: str  # the same for the GPU, or "no GPU"

    def text(self) -> str:
        kv = "" if self.kv is None else f" (KV {fmt_bytes(self.kv)})"
        return f"needs ~{fmt_bytes(self.need)}{kv}: RAM {self.ram}, GPU {self.vram}"


# ---- the Hub ----


def _api():
    from huggingface_hub import HfApi

    return HfApi()


def _hub_error(what: str, e: Exception) -> HubError:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return HubError(f"{what}: {text}")


def _reachable(what: str) -> None:
    """Raise `HubError` at once when the Hub's address does not answer at all (offline, no
    route, refused): huggingface_hub's listings retry a connection error five times with
    backoff, so a search without a network took 23 s to say so."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:  # any answer will do (an HTTP error is still an answer); only a failed transport raises
        get_session().head(constants.ENDPOINT, timeout=REACH_TIMEOUT_S)
    except Exception as e:  # the session's HTTP library is huggingface_hub's to choose
        raise _hub_error(what, e) from e


def search_models(query: str, limit: int = 30) -> list[HubModel]:
    """GGUF repositories whose name matches `query`, most downloaded first."""
    _reachable("searching the Hub failed")
    try:
        found = _api().list_models(search=query.strip() or None, filter="gguf", sort="downloads", limit=limit)
        return [HubModel(m.id, int(getattr(m, "downloads", 0) or 0), int(getattr(m, "likes", 0) or 0))
                for m in found]
    except Exception as e:  # offline, a proxy, the Hub down: said in the dialog
        raise _hub_error("searching the Hub failed", e) from e


def gguf_files(repo_id: str) -> list[HubFile]:
    """The GGUF models of a repository, smallest first: single files, and each model in parts
    as one entry (when all its parts are there)."""
    from huggingface_hub.hf_api import RepoFile

    _reachable(f"listing {repo_id} failed")
    try:
        tree = list(_api().list_repo_tree(repo_id, recursive=True))
    except Exception as e:
        raise _hub_error(f"listing {repo_id} failed", e) from e
    out = []
    split: dict[tuple[str, int], dict[int, HubFile]] = {}  # (path less the part's suffix, parts) -> parts
    for entry in tree:
        if not isinstance(entry, RepoFile) or not entry.path.lower().endswith(".gguf"):
            continue
        if "mmproj" in entry.path.rsplit("/", 1)[-1].lower():  # a vision projector
            continue
        sha = entry.lfs.sha256 if entry.lfs is not None else None
        f = HubFile(repo_id, entry.path, int(entry.size), sha)
        m = SPLIT.search(entry.path)
        if m is None:
            out.append(f)
        else:
            split.setdefault((entry.path[:m.start()], int(m.group(2))), {})[int(m.group(1))] = f
    for (_stem, count), parts in split.items():
        if count < 1 or sorted(parts) != list(range(1, count + 1)):
            continue  # a part is missing: llama.cpp could not load it
        ordered = tuple(parts[i] for i in range(1, count + 1))
        out.append(HubFile(repo_id, ordered[0].path, sum(p.size for p in ordered), None, ordered))
    return sorted(out, key=lambda f: (f.size, f.path))


def model_shape(file: HubFile) -> Shape | None:
    """The KV-relevant shape from the file's GGUF header, read by range; None if unreadable."""
    try:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        n = min(HEADER_BYTES, file.files[0].size)  # a model in parts: its first part holds the header
        headers = {**build_hf_headers(), "Range": f"bytes=0-{n - 1}", "Accept-Encoding": "identity"}
        r = get_session().get(hf_hub_url(file.repo_id, file.path), headers=headers, timeout=HTTP_TIMEOUT_S)
        hf_raise_for_status(r)
        head = r.content[:n]
    except Exception:  # the fit is then priced without KV, and says so
        return None
    return parse_shape(head)


# ---- GGUF header ----

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Truncated(Exception):
    pass


def parse_shape(head: bytes) -> Shape | None:
    """Read a GGUF header's key-value section (from its first bytes) for the model's shape."""
    try:
        meta = _gguf_kv(head, wanted_suffixes=(".block_count", ".attention.head_count",
                                               ".attention.head_count_kv", ".attention.key_length",
                                               ".attention.value_length", ".embedding_length",
                                               ".context_length"))
    except (_Truncated, struct.error, ValueError):
        return None
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        return None

    def get(key, default=None):
        v = meta.get(f"{arch}.{key}", default)
        return v[0] if isinstance(v, list) and v else v

    layers, heads, embed = get("block_count"), get("attention.head_count"), get("embedding_length")
    if not layers or not heads or not embed:
        return None
    kv_heads = get("attention.head_count_kv", heads) or heads
    k = get("attention.key_length", embed // heads)
    v = get("attention.value_length", k)
    return Shape(arch, int(layers), int(kv_heads), int(k), int(v), int(get("context_length", 0) or 0))


def _gguf_kv(head: bytes, wanted_suffixes) -> dict:
    """The header's scalar and string values (arrays of numbers kept, arrays of strings skipped)."""
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(head):
            raise _Truncated
        out = head[pos:pos + n]
        pos += n
        return out

    def string() -> str:
        (n,) = struct.unpack("<Q", take(8))
        return take(n).decode("utf-8", "replace")

    def value(kind: int, keep: bool):
        if kind in _SCALARS:
            fmt = "<" + _SCALARS[kind]
            return struct.unpack(fmt, take(struct.calcsize(fmt)))[0]
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            (inner,) = struct.unpack("<I", take(4))
            (n,) = struct.unpack("<Q", take(8))
            if inner in _SCALARS and not keep:  # skip in one move
                take(n * struct.calcsize("<" + _SCALARS[inner]))
                return None
            items = [value(inner, keep) for _ in range(n)]
            return items if keep else None
        raise ValueError(f"unknown GGUF value type {kind}")

    if take(4) != b"GGUF":
        raise ValueError("not a GGUF file")
    version, = struct.unpack("<I", take(4))
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old")
    _n_tensors, n_kv = struct.unpack("<QQ", take(16))
    meta = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack("<I", take(4))
        keep = key == "general.architecture" or key.endswith(tuple(wanted_suffixes))
        v = value(kind, keep)
        if keep:
            meta[key] = v
        if "general.architecture" in meta and all(
                any(k.endswith(s) for k in meta) for s in (".block_count", ".attention.head_count",
                                                          ".embedding_length")) and key.startswith("tokenizer."):
            break  # the shape is known; the vocabulary that follows is not needed
    return meta


# ---- this machine ----


def machine_memory(vram_total: int = 0) -> Memory:
    """RAM in all and available now (Linux: /proc/meminfo; elsewhere the total for both)."""
    total = available = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh if line.split()[1:]}
        total, available = info.get("MemTotal", 0), info.get("MemAvailable", 0)
    except (OSError, ValueError, IndexError):
        pass
    if not total:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 0
        available = total
    return Memory(total, available or total, vram_total)


def fits(file: HubFile, shape: Shape | None, n_ctx: int, memory: Memory) -> Fit:
    """Whether the model runs here at `n_ctx` cells: weights + KV (f16) + a 10 % margin."""
    kv = shape.kv_bytes(n_ctx) if shape is not None else None
    need = int((file.size + (kv or 0)) * OVERHEAD)

    def verdict(available: int, total: int) -> str:
        if need <= available:
            return "fits"
        return "tight" if need <= total else "too big"

    ram = verdict(memory.ram_available, memory.ram_total) if memory.ram_total else "unknown"
    vram = verdict(memory.vram_total, memory.vram_total) if memory.vram_total else "no GPU"
    return Fit(need, kv, ram, vram)


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB', 8.3e9 -> '7.7 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# ---- download ----


def models_folder() -> Path:
    """Where downloaded models go: this app's data folder (the model picker scans it)."""
    env = os.environ.get("TANDEM_MODELS_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("tandem")) / "models"


def download(file: HubFile, folder: Path | None = None, progress: Progress | None = None,
             cancel: threading.Event | None = None) -> Path:
    """Download `file` (every part of a model in parts) into `folder/<owner>--<repo>/`, resuming
    from the bytes an earlier download left, check each part's sha256, return the path of the
    (first) file. Raises `DownloadCancelled` when `cancel` is set (what came is kept for next
    time) and `HubError` on any failure."""
    folder = Path(folder) if folder is not None else models_folder()
    target = folder / file.repo_id.replace("/", "--")
    cancel = cancel or threading.Event()
    before = 0  # bytes of the parts already done
    for part in file.files:
        def report(done: int, _total: int, before=before) -> None:
            if progress is not None:
                progress(before + done, file.size)

        _download_one(part, target, report, cancel)
        before += part.size
    return target / file.files[0].path


def partial_path(file: HubFile, target: Path) -> Path:
    """Where the bytes of an unfinished download of one file wait (named by its sha256 or size,
    so a file changed on the Hub never resumes from an old one's bytes)."""
    key = file.sha256 or f"size-{file.size}"
    return target / PARTIAL_DIR / f"{file.path}.{key[:16]}"


def partial_bytes(file: HubFile, folder: Path | None = None) -> int:
    """How many bytes of `file` (all its parts) are on disk, finished or waiting to resume."""
    target = (Path(folder) if folder is not None else models_folder()) / file.repo_id.replace("/", "--")
    done = 0
    for part in file.files:
        final, partial = target / part.path, partial_path(part, target)
        if final.is_file() and final.stat().st_size == part.size:
            done += part.size
        elif partial.is_file():
            done += min(partial.stat().st_size, part.size)
    return done


def _download_one(file: HubFile, target: Path, progress: Progress, cancel: threading.Event) -> None:
    final = target / file.path
    if final.is_file() and final.stat().st_size == file.size and (
            not file.sha256 or sha256_of(final, cancel) == file.sha256):
        progress(file.size, file.size)  # finished and checked before (a model in parts stopped later)
        return
    partial = partial_path(file, target)
    partial.parent.mkdir(parents=True, exist_ok=True)
    if partial.is_file() and partial.stat().st_size > file.size:
        partial.unlink()  # not a beginning of this file
    resume = partial.stat().st_size if partial.is_file() else 0
    if resume < file.size:
        _fetch(file, partial, resume, progress, cancel)
    if file.sha256:
        got = sha256_of(partial, cancel)  # a stop here keeps the bytes: the check runs again next time
        if got != file.sha256:
            partial.unlink(missing_ok=True)
            raise HubError(f"{file.name}: the downloaded file's sha256 {got[:12]}… is not the Hub's "
                           f"{file.sha256[:12]}…; it was deleted, try again")
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(partial, final)
    progress(file.size, file.size)


def _fetch(file: HubFile, partial: Path, resume: int, progress: Progress, cancel: threading.Event) -> None:
    """Append the bytes of `file` from `resume` on to `partial` with huggingface_hub's `http_get`;
    `DownloadCancelled` once `cancel` is set, `HubError` for anything else that fails."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    try:
        with open(partial, "ab") as fh:
            http_get(hf_hub_url(file.repo_id, file.path), fh, resume_size=resume,
                     headers=build_hf_headers(), expected_size=file.size, displayed_filename=file.name,
                     tqdm_class=_progress_bar(progress, cancel))
    except DownloadCancelled:
        raise
    except Exception as e:
        if cancel.is_set():
            raise DownloadCancelled("download stopped") from e
        raise _hub_error(f"downloading {file.name} failed", e) from e


def _progress_bar(progress: Progress, cancel: threading.Event) -> type:
    """huggingface_hub's progress bar class, reporting to `progress` and stopping once `cancel` is set."""
    from tqdm import tqdm

    class _Bar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = False
            kwargs["file"] = open(os.devnull, "w")  # noqa: SIM115  (closed in close())
            super().__init__(*args, **kwargs)
            self._report()

        def update(self, n=1):
            if cancel.is_set():  # before the chunk is written: the partial file stays a clean prefix
                raise DownloadCancelled("download stopped")
            out = super().update(n)
            self._report()
            return out

        def _report(self):
            if self.total:
                progress(int(self.n), int(self.total))

        def close(self):
            fp = self.fp
            super().close()
            try:
                fp.close()
            except Exception:
                pass

    return _Bar


def sha256_of(path: Path, cancel: threading.Event | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            if cancel is not None and cancel.is_set():
                raise DownloadCancelled("checksum stopped")
            h.update(block)
    return h.hexdigest()
