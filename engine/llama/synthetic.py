"""Random-weight GGUF models with the exact shape of a real model, for timing only.

The files written here have the architecture, tensor names, tensor shapes, hyper-parameters
and (padded) vocabulary size of a real model, so llama.cpp spends the same time and memory
on them as on the real thing: loading, prompt processing, generation, KV cache, quantization.
The weights are random (deterministic, from a fixed seed), so **the text they generate is
noise**: use them to measure speed and to exercise the engine, never to judge output.

The tokenizer is a small byte-level SentencePiece ("llama") vocabulary: the control tokens
``<unk> <s> </s>``, the 256 byte tokens ``<0x00>``..``<0xFF>`` (so any text tokenizes, by byte
fallback, and detokenizes back to the same bytes), ``<|im_start|>``/``<|im_end|>`` for a
chatml-like ``tokenizer.chat_template``, then printable ASCII characters and letter pieces
(``▁ab``, ``xyz``, ...) up to the model's vocabulary size. The output rows of every control
and byte token are zero while ordinary pieces get logits of standard deviation ~2, so greedy
and top-k/min-p sampling only ever pick ordinary pieces: a synthetic model does not end a
reply with EOS by itself (generation runs to ``max_tokens`` or a stop string) and writes valid
UTF-8 made of letters, digits, punctuation and spaces. (Pure temperature sampling with every
filter off can still pick them, rarely for the large vocabulary, often for ``tiny``.)

Public API:

* ``SHAPES`` -- shape name -> :class:`SyntheticShape` (``tiny``, ``qwen2.5-0.5b``).
* ``QUANTS`` -- quantization name -> llama.cpp ``llama_ftype`` constant name (``f16`` first).
* ``parse_spec(spec)`` -- ``"qwen2.5-0.5b:q8_0"`` -> ``(shape, quant)``; ``ModelLoadError`` if unknown.
* ``synthetic_path(spec, progress=None)`` -- the cached GGUF file for a spec, written on first use.
* ``cache_dir()`` -- where the files live (``$TANDEM_CACHE_DIR/models`` or the user cache dir).
* ``write_gguf(shape, path, progress=None)`` -- write one f16 file for any shape (no caching).
* ``quantize(src, dst, quant)`` -- llama.cpp's own quantizer, f16 file -> quantized file.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import string
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.core.errors import ModelLoadError

__all__ = [
    "DEFAULT_QUANT",
    "QUANTS",
    "SHAPES",
    "Progress",
    "SyntheticShape",
    "cache_dir",
    "file_name",
    "parse_spec",
    "quantize",
    "spec_names",
    "synthetic_path",
    "write_gguf",
]

Progress = Callable[[int, int], None]
"""``progress(done, total)``: called as work proceeds (bytes, monotonic, ends with done == total)."""

SEED = 20240917
"""Base seed of every synthetic file: the same shape always gets the same weights."""

FORMAT_VERSION = 1
"""Written to each file as ``tandem.synthetic.version``; bump when the content for a shape changes."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class SyntheticShape:
    """Everything that decides a synthetic model's tensors and llama.cpp hyper-parameters."""

    name: str
    arch: str  # llama.cpp architecture: "llama" or "qwen2"
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rope_theta: float
    rms_eps: float
    attn_bias: bool  # q/k/v projections carry a bias (Qwen2)
    tied_embeddings: bool  # no output.weight: llama.cpp reuses token_embd.weight
    description: str = ""

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_embd_kv(self) -> int:
        return self.head_dim * self.n_head_kv

    @property
    def n_params(self) -> int:
        """Number of weights in the file (what ``llama_model_n_params`` reports)."""
        return sum(int(np.prod(t.shape)) for t in _tensor_plan(self))


SHAPES: dict[str, SyntheticShape] = {
    s.name: s
    for s in (
        SyntheticShape(
            name="tiny",
            arch="llama",
            n_layer=2,
            n_embd=64,
            n_head=4,
            n_head_kv=2,
            n_ff=128,
            n_vocab=512,
            n_ctx_train=4096,
            rope_theta=10000.0,
            rms_eps=1e-5,
            attn_bias=False,
            tied_embeddings=False,
            description="a ~0.1M-parameter llama-architecture model for fast tests",
        ),
        SyntheticShape(
            name="qwen2.5-0.5b",
            arch="qwen2",
            n_layer=24,
            n_embd=896,
            n_head=14,
            n_head_kv=2,
            n_ff=4864,
            n_vocab=151936,
            n_ctx_train=32768,
            rope_theta=1000000.0,
            rms_eps=1e-6,
            attn_bias=True,
            tied_embeddings=True,
            description="the shape of Qwen2.5-0.5B-Instruct (494M parameters, tied embeddings)",
        ),
    )
}

# quant name -> name of the llama_ftype constant in llama_cpp (resolved lazily: see quantize()).
QUANTS: dict[str, str] = {
    "f16": "LLAMA_FTYPE_MOSTLY_F16",
    "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q5_k_s": "LLAMA_FTYPE_MOSTLY_Q5_K_S",
    "q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1",
    "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0",
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
    "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
    "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K",
}
DEFAULT_QUANT = "f16"


# --------------------------------------------------------------------------- specs and paths


def spec_names() -> list[str]:
    """Every valid spec, shape alone (= f16) first."""
    return list(SHAPES) + [f"{s}:{q}" for s in SHAPES for q in QUANTS]


def parse_spec(spec: str) -> tuple[SyntheticShape, str]:
    """``"tiny"`` / ``"qwen2.5-0.5b:q4_k_m"`` -> ``(shape, quant)``. Case-insensitive."""
    if not isinstance(spec, str):
        raise ModelLoadError(f"a synthetic model spec is a string, got {type(spec).__name__}", param="model")
    name, sep, quant = spec.strip().lower().partition(":")
    quant = quant.strip() if sep else DEFAULT_QUANT
    shape = SHAPES.get(name.strip())
    if shape is None:
        raise ModelLoadError(
            f"unknown synthetic model shape {name.strip()!r}; valid shapes: {', '.join(SHAPES)}",
            param="model",
        )
    if quant not in QUANTS:
        raise ModelLoadError(
            f"unknown quantization {quant!r} for synthetic model {shape.name!r}; "
            f"valid quantizations: {', '.join(QUANTS)}",
            param="model",
        )
    return shape, quant


def file_name(shape: SyntheticShape, quant: str) -> str:
    return f"synthetic-{shape.name}-{quant}.gguf"


def cache_dir() -> Path:
    """``$TANDEM_CACHE_DIR/models`` if set, else ``platformdirs.user_cache_dir("tandem")/models``."""
    root = os.environ.get("TANDEM_CACHE_DIR")
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("tandem")
    return Path(root).expanduser() / "models"


def synthetic_path(spec: str, progress: Progress | None = None) -> Path:
    """Path of the GGUF file for ``spec``, generating (and quantizing) it on first use.

    A file that exists is returned as is. Otherwise it is written under a temporary name and
    renamed into place, under a lock file, so concurrent callers (threads or processes) wait for
    one writer and a crash never leaves a partial file under the final name. ``progress``, if
    given, is called with ``(done, total)`` in bytes: first while the f16 weights are written,
    then once more when quantization (which reports nothing on the way) has finished.
    """
    shape, quant = parse_spec(spec)
    directory = cache_dir()
    path = directory / file_name(shape, quant)
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    f16_path = directory / file_name(shape, DEFAULT_QUANT)
    f16_bytes = _data_bytes(shape)
    need_f16 = not f16_path.is_file()
    total = (f16_bytes if need_f16 else 0) + (f16_bytes if quant != DEFAULT_QUANT else 0)

    with _locked(f16_path):
        if not f16_path.is_file():
            with _temp_for(f16_path) as tmp:
                write_gguf(shape, tmp, progress=progress, _total=total)
        elif need_f16 and progress is not None:  # another process wrote it while we waited
            progress(f16_bytes, total)
    if quant == DEFAULT_QUANT:
        return f16_path

    with _locked(path):
        if not path.is_file():
            with _temp_for(path) as tmp:
                quantize(f16_path, tmp, quant)
    if progress is not None:
        progress(total, total)
    return path


# --------------------------------------------------------------------------- writing


@dataclass(frozen=True, slots=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, cols); GGUF/ggml ne is the reverse
    kind: str  # "norm" (ones), "bias", "matrix", "embd" (token_embd), "output"

    @property
    def dtype(self) -> type:
        return np.float32 if len(self.shape) == 1 else np.float16

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def _tensor_plan(shape: SyntheticShape) -> list[_Tensor]:
    """The tensors llama.cpp's loader expects for ``shape.arch``, in file order."""
    e, kv, ff, v = shape.n_embd, shape.n_embd_kv, shape.n_ff, shape.n_vocab
    plan = [_Tensor("token_embd.weight", (v, e), "embd"), _Tensor("output_norm.weight", (e,), "norm")]
    if not shape.tied_embeddings:
        plan.append(_Tensor("output.weight", (v, e), "output"))
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        plan += [
            _Tensor(p + "attn_norm.weight", (e,), "norm"),
            _Tensor(p + "attn_q.weight", (e, e), "matrix"),
            _Tensor(p + "attn_k.weight", (kv, e), "matrix"),
            _Tensor(p + "attn_v.weight", (kv, e), "matrix"),
        ]
        if shape.attn_bias:
            plan += [
                _Tensor(p + "attn_q.bias", (e,), "bias"),
                _Tensor(p + "attn_k.bias", (kv,), "bias"),
                _Tensor(p + "attn_v.bias", (kv,), "bias"),
            ]
        plan += [
            _Tensor(p + "attn_output.weight", (e, e), "matrix"),
            _Tensor(p + "ffn_norm.weight", (e,), "norm"),
            _Tensor(p + "ffn_gate.weight", (ff, e), "matrix"),
            _Tensor(p + "ffn_down.weight", (e, ff), "matrix"),
            _Tensor(p + "ffn_up.weight", (ff, e), "matrix"),
        ]
    return plan


def _data_bytes(shape: SyntheticShape) -> int:
    return sum(t.nbytes for t in _tensor_plan(shape))


# token ids of the fixed head of every vocabulary
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE0_ID = 3
IM_START_ID, IM_END_ID = BYTE0_ID + 256, BYTE0_ID + 257
N_FIXED = IM_END_ID + 1  # ids below this are control/byte tokens: never generated
SPACE = "\u2581"  # SentencePiece's visible space


def _letter_pieces() -> Iterator[str]:
    yield SPACE
    for c in string.printable[:94]:  # digits, letters, punctuation (no whitespace)
        yield c
    letters = string.ascii_lowercase
    for c in letters:
        yield SPACE + c
    for n in itertools.count(2):
        for combo in itertools.product(letters, repeat=n):
            piece = "".join(combo)
            yield piece
            yield SPACE + piece


def _vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["<|im_start|>", "<|im_end|>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    types += [TokenType.CONTROL, TokenType.CONTROL]
    if n_vocab < N_FIXED + 95:
        raise ValueError(f"n_vocab must be at least {N_FIXED + 95}")
    tokens += list(itertools.islice(_letter_pieces(), n_vocab - N_FIXED))
    types += [TokenType.NORMAL] * (n_vocab - N_FIXED)
    # SentencePiece merges the highest-scoring pair first: prefer earlier (shorter) pieces.
    scores = [0.0] * N_FIXED + [-float(i) for i in range(n_vocab - N_FIXED)]
    return tokens, scores, [int(t) for t in types]


def write_gguf(
    shape: SyntheticShape,
    path: str | os.PathLike[str],
    progress: Progress | None = None,
    *,
    _total: int | None = None,
) -> Path:
    """Write ``shape`` as an f16 GGUF file at ``path`` (overwriting it), one chunk at a time.

    Memory stays at a few tens of MB whatever the model size. Matrices are F16, norms and biases
    F32 (as llama.cpp's converters write them). Deterministic: same shape, same bytes.
    """
    import gguf

    path = Path(path)
    plan = _tensor_plan(shape)
    data_total = sum(t.nbytes for t in plan)
    total = data_total if _total is None else _total

    w = gguf.GGUFWriter(path, shape.arch)
    try:
        w.add_name(f"synthetic-{shape.name}")
        w.add_description(f"Tandem synthetic model: random weights with {shape.description}; output is noise")
        w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
        w.add_context_length(shape.n_ctx_train)
        w.add_embedding_length(shape.n_embd)
        w.add_block_count(shape.n_layer)
        w.add_feed_forward_length(shape.n_ff)
        w.add_head_count(shape.n_head)
        w.add_head_count_kv(shape.n_head_kv)
        w.add_rope_dimension_count(shape.head_dim)
        w.add_rope_freq_base(shape.rope_theta)
        w.add_layer_norm_rms_eps(shape.rms_eps)
        w.add_vocab_size(shape.n_vocab)
        w.add_key_value("tandem.synthetic.shape", shape.name, gguf.GGUFValueType.STRING)
        w.add_key_value("tandem.synthetic.version", FORMAT_VERSION, gguf.GGUFValueType.UINT32)

        tokens, scores, types = _vocab(shape.n_vocab)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(UNK_ID)
        w.add_bos_token_id(BOS_ID)
        w.add_eos_token_id(EOS_ID)
        w.add_eot_token_id(IM_END_ID)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(False)
        w.add_chat_template(CHAT_TEMPLATE)

        for t in plan:
            w.add_tensor_info(t.name, t.shape, np.dtype(t.dtype), t.nbytes)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()

        assert w.fout is not None and len(w.fout) == 1
        fout = w.fout[0]
        w.write_padding(fout, fout.tell())
        done = 0
        for index, t in enumerate(plan):
            for chunk in _tensor_chunks(shape, t, index):
                fout.write(chunk.data.cast("B"))
                done += chunk.nbytes
                if progress is not None:
                    progress(done, total)
            w.write_padding(fout, t.nbytes)
        fout.flush()
        os.fsync(fout.fileno())
    finally:
        w.close()
    return path


_CHUNK_ELEMENTS = 1 << 22  # 4M values: 16 MB of float32 scratch


def _tensor_chunks(shape: SyntheticShape, t: _Tensor, index: int) -> Iterator[np.ndarray]:
    """The tensor's values in row chunks. Scales keep activations O(1) through the layers."""
    if t.kind == "norm":
        yield np.ones(t.shape, dtype=np.float32)
        return
    rng = np.random.default_rng([SEED, index])
    if t.kind == "bias":
        yield (rng.standard_normal(t.shape, dtype=np.float32) * np.float32(0.02)).astype(np.float32)
        return
    rows, cols = t.shape
    # logits get a standard deviation of about 2 over the normal tokens; the rest fan-in scaling,
    # so each projection keeps the RMS of its input
    std = 2.0 / np.sqrt(shape.n_embd) if t.kind in ("embd", "output") else 1.0 / np.sqrt(cols)
    zero_rows = N_FIXED if (t.kind == "output" or (t.kind == "embd" and shape.tied_embeddings)) else 0
    step = max(1, _CHUNK_ELEMENTS // cols)
    scratch = np.empty((min(step, rows), cols), dtype=np.float32)
    out16 = np.empty_like(scratch, dtype=np.float16)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        buf = scratch[:n]
        rng.standard_normal(out=buf, dtype=np.float32)
        buf *= np.float32(std)
        if r0 < zero_rows:
            buf[: zero_rows - r0] = 0.0
        np.copyto(out16[:n], buf, casting="same_kind")
        yield out16[:n]


# --------------------------------------------------------------------------- quantizing


def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], quant: str) -> Path:
    """Quantize the f16 GGUF ``src`` into ``dst`` with llama.cpp's ``llama_model_quantize``.

    llama.cpp's log lines are silenced while it runs (through llama_cpp's Python logger).
    """
    if quant not in QUANTS:
        raise ModelLoadError(f"unknown quantization {quant!r}; valid quantizations: {', '.join(QUANTS)}")
    import llama_cpp  # lazily: importing it loads the native library

    ftype = getattr(llama_cpp, QUANTS[quant], None)
    if ftype is None:
        raise ModelLoadError(f"this llama_cpp has no {QUANTS[quant]} for quantization {quant!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = os.cpu_count() or 1
    params.ftype = ftype
    llama_cpp.llama_backend_init()
    with _quiet_llama():
        rc = llama_cpp.llama_model_quantize(
            os.fsencode(os.fspath(src)), os.fsencode(os.fspath(dst)), ctypes.byref(params)
        )
    if rc != 0:
        raise ModelLoadError(f"llama.cpp failed to quantize {os.fspath(src)} to {quant} (code {rc})")
    return Path(dst)


# Python loggers that llama.cpp's log callback may feed: engine.llama's and llama_cpp's own
# (llama_cpp._logger prints to stderr unless its logger's level is above the message's).
_LLAMA_LOGGERS = ("llama.cpp", "llama-cpp-python")


@contextlib.contextmanager
def _quiet_llama() -> Iterator[None]:
    """Silence llama.cpp's log lines (expected "falling back to q5_0" warnings and the like).

    Raises the level of the Python loggers that llama.cpp's log callback feeds, whichever
    callback is installed, and restores them after. The levels are process-wide, so lines from
    other threads are dropped meanwhile too; a failed quantization is still reported, as
    ModelLoadError. CRITICAL, not ERROR: llama_cpp maps ggml's WARN level to ERROR.
    """
    loggers = [logging.getLogger(name) for name in _LLAMA_LOGGERS]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, old):
            lg.setLevel(level)


# --------------------------------------------------------------------------- files


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Exclusive lock on ``.<name>.lock`` next to ``path``; released on exit or process death."""
    lock_path = path.with_name(f".{path.name}.lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _lock_fd(fd)
        try:
            yield
        finally:
            _unlock_fd(fd)
    finally:
        os.close(fd)


if sys.platform != "win32":
    import fcntl

    def _lock_fd(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX)

    def _unlock_fd(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)

else:  # pragma: no cover - Windows
    import msvcrt
    import time

    def _lock_fd(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        while True:
            try:
                msvcrt.locking(fd, msvcrt.LK_LOCK, 1)
                return
            except OSError:  # LK_LOCK gives up after ~10 s; keep waiting for the writer
                time.sleep(0.5)

    def _unlock_fd(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


@contextlib.contextmanager
def _temp_for(path: Path) -> Iterator[Path]:
    """A fresh temporary path next to ``path``, renamed onto it if the block succeeds.

    Call under ``_locked(path)``: leftovers of writers that crashed are removed first.
    """
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        with contextlib.suppress(OSError):
            stale.unlink()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
