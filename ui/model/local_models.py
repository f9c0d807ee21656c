"""Models already on this machine: GGUF files in the folders other local-LLM apps use, and the
models loaded recently, each with its real name from the GGUF metadata (`general.name`).

Where it looks (`model_folders()`; each folder only if it exists):
- the Hugging Face hub cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else ~/.cache/huggingface/hub):
  `*.gguf` under each repository's `snapshots/` (links into `blobs/`);
- LM Studio's (~/.lmstudio/models, and the older ~/.cache/lm-studio/models);
- Ollama-style stores (`$OLLAMA_MODELS`, else ~/.ollama/models): each manifest under
  `manifests/` names its model layer, a GGUF blob `blobs/sha256-…` with no extension; the entry
  is called `name:tag` after the manifest;
- ~/models, and this app's data folder (`platformdirs.user_data_dir("tandem")/models`).

`scan(folders)` walks them (bounded: `MAX_FILES` files, `MAX_DEPTH` levels) and reads each file's
header with the `gguf` package (memory-mapped; only the metadata is read). A file that is not
GGUF or cannot be read is listed with its error rather than dropped, so the user sees why. A
model in parts (`name-00001-of-00003.gguf`) is listed once, as its first part (what llama.cpp
loads), at the parts' total size.

Pure functions, no Qt: any thread (the model dialog runs `scan` on a worker thread).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

MAX_FILES = 500  # per scan: a home folder full of models still lists in seconds
MAX_DEPTH = 6  # levels under a folder (HF: models--org--name/snapshots/<rev>/file.gguf is 3)
RECENT_MAX = 10
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)  # llama.cpp's gguf-split names


@dataclass(frozen=True)
class LocalModel:
    path: str
    name: str  # GGUF general.name, else the file name
    source: str  # the folder's label: "Hugging Face cache", "LM Studio", "Ollama", "~/models", …
    size: int = 0  # bytes
    architecture: str = ""
    size_label: str = ""  # general.size_label, e.g. "135M"
    alias: str = ""  # Ollama's name:tag
    error: str = ""  # why the metadata could not be read

    def title(self) -> str:
        """One line for a list: the real name, what it is, where it lies."""
        bits = [b for b in (self.architecture, self.size_label, _size(self.size)) if b]
        head = self.alias or self.name
        if self.alias and self.name and self.name != self.alias:
            head += f" ({self.name})"
        return head + (f" · {' · '.join(bits)}" if bits else "") + (f" · {self.error}" if self.error else "")


def model_folders(env: Mapping[str, str] | None = None, home: Path | None = None) -> list[tuple[str, Path, str]]:
    """(label, folder, kind) for each place to look; kind is "files" or "ollama"."""
    env = os.environ if env is None else env
    home = Path(home) if home is not None else Path.home()
    hf = env.get("HF_HUB_CACHE") or (str(Path(env["HF_HOME"]) / "hub") if env.get("HF_HOME") else None)
    out = [("Hugging Face cache", Path(hf) if hf else home / ".cache" / "huggingface" / "hub", "files"),
           ("LM Studio", home / ".lmstudio" / "models", "files"),
           ("LM Studio", home / ".cache" / "lm-studio" / "models", "files"),
           ("Ollama", Path(env["OLLAMA_MODELS"]) if env.get("OLLAMA_MODELS") else home / ".ollama" / "models",
            "ollama"),
           ("~/models", home / "models", "files")]
    try:
        import platformdirs

        out.append(("Tandem", Path(platformdirs.user_data_dir("tandem")) / "models", "files"))
    except ImportError:  # the GPU machine has no platformdirs; the app always does
        pass
    return out


def read_model(path: str | Path, source: str = "", alias: str = "") -> LocalModel:
    """A file's entry, its name and shape from the GGUF header (or the reason it has none)."""
    path = Path(path)
    try:
        size = path.stat().st_size + _other_parts_size(path)
    except OSError as e:
        return LocalModel(str(path), path.stem, source, alias=alias, error=f"cannot read: {e.strerror or e}")
    try:
        with path.open("rb") as fh:
            if fh.read(4) != b"GGUF":
                return LocalModel(str(path), path.stem, source, size, alias=alias, error="not a GGUF file")
        meta = gguf_metadata(path, ("general.name", "general.architecture", "general.size_label"))
    except Exception as e:  # a broken file is listed with why, the scan goes on
        return LocalModel(str(path), path.stem, source, size, alias=alias, error=f"unreadable GGUF header: {e}")
    return LocalModel(str(path), meta.get("general.name") or path.stem, source, size,
                      meta.get("general.architecture", ""), meta.get("general.size_label", ""), alias)


def gguf_metadata(path: str | Path, keys) -> dict[str, str]:
    """String metadata of a GGUF file (only `keys` that it has)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path), "r")
    out = {}
    for key in keys:
        field = reader.get_field(key)
        if field is not None:
            value = field.contents()
            out[key] = value if isinstance(value, str) else str(value)
    return out


def scan(folders=None, max_files: int = MAX_FILES) -> list[LocalModel]:
    """Every GGUF model under `folders` ((label, folder, kind) as `model_folders()` gives), each
    file once (links resolved), in folder order then by name."""
    folders = model_folders() if folders is None else folders
    seen: set[str] = set()
    out: list[LocalModel] = []
    for label, folder, kind in folders:
        folder = Path(folder)
        if not folder.is_dir():
            continue
        found = _ollama(folder) if kind == "ollama" else [(p, "") for p in _gguf_files(folder)]
        batch = []
        for path, alias in found:
            if len(seen) >= max_files:
                break
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            batch.append(read_model(path, label, alias))
        out += sorted(batch, key=lambda m: (m.alias or m.name).lower())
    return out


def remember(recent: list[str], model: str, keep: int = RECENT_MAX) -> list[str]:
    """The recent-models list with `model` first (once), at most `keep` long."""
    return ([model] + [m for m in recent if m != model])[:keep]


def recent_entries(recent: list[str]) -> list[LocalModel]:
    """Entries for the recent list: files read for their names; `default` and synthetic specs as
    they are; files that are gone say so."""
    out = []
    for spec in recent:
        if spec == "default" or spec.startswith("synthetic:") or "://" in spec:
            out.append(LocalModel(spec, spec, "recent"))
        else:
            out.append(read_model(spec, "recent") if Path(spec).exists()
                       else LocalModel(spec, Path(spec).stem, "recent", error="file no longer there"))
    return out


def _other_parts_size(path: Path) -> int:
    """The bytes of a first part's other parts on disk (0 for a model in one file)."""
    m = SPLIT.search(path.name)
    if m is None or int(m.group(1)) != 1:
        return 0
    stem, count = path.name[:m.start()], int(m.group(2))
    others = (path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(2, count + 1))
    return sum(p.stat().st_size for p in others if p.is_file())


def _gguf_files(folder: Path):
    for root, dirs, files in os.walk(folder, followlinks=False):
        depth = len(Path(root).relative_to(folder).parts)
        if depth >= MAX_DEPTH:
            dirs.clear()
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "blobs")
        for f in sorted(files):
            part = SPLIT.search(f)
            if f.lower().endswith(".gguf") and (part is None or int(part.group(1)) == 1):  # a model once
                yield Path(root) / f


def _ollama(folder: Path):
    """(blob path, "name:tag") for each manifest whose model layer is on disk."""
    manifests = folder / "manifests"
    if not manifests.is_dir():
        return
    for root, _dirs, files in os.walk(manifests):
        for tag in sorted(files):
            manifest = Path(root) / tag
            try:
                layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
            except (OSError, ValueError, AttributeError):
                continue
            for layer in layers:
                if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER:
                    blob = folder / "blobs" / str(layer.get("digest", "")).replace(":", "-")
                    if blob.is_file():
                        model = manifest.parent.name
                        yield blob, f"{model}:{tag}"


def _size(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.0f} MB"
    return f"{n / 1024:.0f} KB" if n else ""
