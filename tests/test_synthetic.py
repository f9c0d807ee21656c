"""Synthetic random-weight GGUF models: shapes, caching, tokenizer, quantization, llama.cpp loading.

Only tiny models are written here; the 1 GB qwen2.5-0.5b file is checked through its metadata
and through a small model of the same architecture (qwen2, q/k/v biases, tied embeddings).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading

import llama_cpp  # before numpy (via engine.llama.synthetic): the GPU machine crashes otherwise
import pytest

from engine.core.errors import ModelLoadError
from engine.llama import CPU_REPACK, synthetic
from engine.llama.synthetic import SHAPES, parse_spec, synthetic_path, write_gguf


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.fixture(scope="module", autouse=True)
def backend():
    llama_cpp.llama_backend_init()
    yield


class Model:
    """A llama.cpp model loaded through the low-level API, freed on exit."""

    def __init__(self, path):
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = CPU_REPACK  # ggml's AMX kernel crashes on some AMX CPUs (engine/llama/__init__.py)
        self.ptr = llama_cpp.llama_model_load_from_file(os.fsencode(str(path)), params)
        assert self.ptr, f"llama.cpp refused {path}"
        self.vocab = llama_cpp.llama_model_get_vocab(self.ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        llama_cpp.llama_model_free(self.ptr)

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = llama_cpp.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode()

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        data = text.encode()
        out = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), out, len(out), True, special)
        assert n >= 0
        return list(out[:n])

    def detokenize(self, tokens: list[int]) -> bytes:
        buf = ctypes.create_string_buffer(64)
        pieces = []
        for t in tokens:
            n = llama_cpp.llama_token_to_piece(self.vocab, t, buf, len(buf), 0, False)
            assert 0 <= n <= len(buf)
            pieces.append(buf.raw[:n])
        return b"".join(pieces)


def greedy(model: Model, prompt: str, n: int) -> list[int]:
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = 256
    cparams.n_batch = 256
    cparams.n_threads = cparams.n_threads_batch = 1
    ctx = llama_cpp.llama_init_from_model(model.ptr, cparams)
    assert ctx
    smpl = llama_cpp.llama_sampler_init_greedy()
    try:
        toks = model.tokenize(prompt)
        arr = (llama_cpp.llama_token * len(toks))(*toks)
        assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(toks))) == 0
        out = []
        for _ in range(n):
            tok = llama_cpp.llama_sampler_sample(smpl, ctx, -1)
            out.append(tok)
            one = (llama_cpp.llama_token * 1)(tok)
            assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(one, 1)) == 0
        return out
    finally:
        llama_cpp.llama_sampler_free(smpl)
        llama_cpp.llama_free(ctx)


# ---- shapes and specs ----


def test_qwen_shape_is_exactly_qwen2_5_0_5b():
    s = SHAPES["qwen2.5-0.5b"]
    assert (s.arch, s.n_layer, s.n_embd, s.n_head, s.n_head_kv, s.n_ff, s.n_vocab) == (
        "qwen2", 24, 896, 14, 2, 4864, 151936,
    )
    assert (s.n_ctx_train, s.rope_theta, s.rms_eps) == (32768, 1e6, 1e-6)
    assert s.attn_bias and s.tied_embeddings
    assert (s.head_dim, s.n_embd_kv) == (64, 128)
    assert s.n_params == 494_032_768  # what llama.cpp reports for the real (and the synthetic) model
    names = [t.name for t in synthetic._tensor_plan(s)]  # the writer's plan: internal, tested as such
    assert len(names) == 2 + 24 * 12 and "output.weight" not in names
    assert {"blk.23.attn_q.bias", "blk.23.attn_k.bias", "blk.23.attn_v.bias"} <= set(names)
    assert synthetic._data_bytes(s) == 988_208_640


def test_tiny_shape_is_small():
    s = SHAPES["tiny"]
    assert (s.n_layer, s.n_embd, s.n_head, s.n_head_kv, s.n_ff, s.n_ctx_train) == (2, 64, 4, 2, 128, 4096)
    assert s.n_params < 200_000


@pytest.mark.parametrize(
    "spec, name, quant",
    [
        ("tiny", "tiny", "f16"),
        ("tiny:f16", "tiny", "f16"),
        ("qwen2.5-0.5b", "qwen2.5-0.5b", "f16"),
        ("qwen2.5-0.5b:q8_0", "qwen2.5-0.5b", "q8_0"),
        ("Qwen2.5-0.5B:Q4_K_M", "qwen2.5-0.5b", "q4_k_m"),
        (" tiny : q4_1 ", "tiny", "q4_1"),
    ],
)
def test_parse_spec(spec, name, quant):
    shape, q = parse_spec(spec)
    assert (shape.name, q) == (name, quant)
    assert synthetic.file_name(shape, q) == f"synthetic-{name}-{quant}.gguf"


@pytest.mark.parametrize("spec", ["huge", "", "qwen2.5-7b:q8_0", "tiny:q9_9", "tiny:", "qwen2.5-0.5b:bf16"])
def test_unknown_spec_raises_model_load_error(spec, cache):
    with pytest.raises(ModelLoadError) as err:
        synthetic_path(spec)
    msg = str(err.value)
    assert ("tiny" in msg and "qwen2.5-0.5b" in msg) or ("q8_0" in msg and "q4_k_m" in msg)
    assert err.value.kind == "model_load_error"
    assert not cache.exists() or not any(cache.iterdir())


def test_every_quant_is_a_llama_cpp_ftype():
    for quant, const in synthetic.QUANTS.items():
        assert isinstance(getattr(llama_cpp, const), int), quant
    assert all(spec in synthetic.spec_names() for spec in ("tiny", "tiny:q8_0", "qwen2.5-0.5b:q4_k_m"))


def test_cache_dir_default_is_user_cache(monkeypatch):
    import platformdirs

    monkeypatch.delenv("TANDEM_CACHE_DIR")
    assert synthetic.cache_dir() == platformdirs.user_cache_dir("tandem") / synthetic.Path("models")


# ---- tiny: write, load, reuse ----


def test_tiny_is_written_once_as_a_loadable_model(cache):
    calls = []
    path = synthetic_path("tiny", progress=lambda done, total: calls.append((done, total)))
    assert path == cache / "synthetic-tiny-f16.gguf" and path.is_file()
    assert calls and calls[-1][0] == calls[-1][1] > 0
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert not list(cache.glob("*.tmp")) and not list(cache.glob(".*.tmp"))

    with Model(path) as m:
        assert llama_cpp.llama_model_n_layer(m.ptr) == 2
        assert llama_cpp.llama_model_n_embd(m.ptr) == 64
        assert llama_cpp.llama_model_n_params(m.ptr) == SHAPES["tiny"].n_params
        assert llama_cpp.llama_vocab_n_tokens(m.vocab) == SHAPES["tiny"].n_vocab
        assert m.meta("general.architecture") == "llama"
        assert m.meta("tandem.synthetic.shape") == "tiny"
        assert "noise" in m.meta("general.description")

    mtime = path.stat().st_mtime_ns
    calls.clear()
    assert synthetic_path("tiny", progress=lambda d, t: calls.append((d, t))) == path
    assert path.stat().st_mtime_ns == mtime
    assert calls == []


def test_generation_is_deterministic(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(SHAPES["tiny"], a)
    write_gguf(SHAPES["tiny"], b)
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize(
    "text",
    ["Hello, wörld!", "", "  two leading spaces, trailing  ", "tabs\tnew\nlines\r\n", "llama 🦙 ünïcödé 日本語", "ABC xyz 123 {}[]"],
)
def test_tokenizer_round_trips_bytes(text):
    with Model(synthetic_path("tiny")) as m:
        tokens = m.tokenize(text)
        assert tokens[0] == llama_cpp.llama_vocab_bos(m.vocab) == synthetic.BOS_ID
        assert m.detokenize(tokens[1:]) == text.encode()


def test_tokenizer_round_trips_through_high_level_api():
    llm = llama_cpp.Llama(str(synthetic_path("tiny")), vocab_only=True, verbose=False)
    text = "Hello, wörld!"
    tokens = llm.tokenize(text.encode())
    assert tokens[0] == llm.token_bos()
    assert llm.detokenize(tokens).decode() == text
    assert llm.detokenize(tokens[1:]).decode() == text


def test_the_chat_template_formats_into_special_tokens():
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    path = synthetic_path("tiny")
    with Model(path) as m:
        template = llama_cpp.llama_model_chat_template(m.ptr, None)
        assert template and template.decode() == synthetic.CHAT_TEMPLATE
        fmt = Jinja2ChatFormatter(template.decode(), eos_token="</s>", bos_token="<s>")
        prompt = fmt(messages=[{"role": "user", "content": "Hi"}]).prompt
        assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        tokens = m.tokenize(prompt, special=True)
        assert tokens[1] == synthetic.IM_START_ID and synthetic.IM_END_ID in tokens
        assert llama_cpp.llama_vocab_is_eog(m.vocab, synthetic.IM_END_ID)
        assert llama_cpp.llama_vocab_is_eog(m.vocab, synthetic.EOS_ID)


def test_tiny_greedy_generation_is_deterministic_over_ordinary_pieces():
    with Model(synthetic_path("tiny")) as m:
        first = greedy(m, "Once upon a time", 64)
        assert greedy(m, "Once upon a time", 64) == first
        assert len(set(first)) > 4
        # only ordinary pieces are ever chosen: no EOS, no control or byte tokens
        assert min(first) >= synthetic.N_FIXED
        assert not any(llama_cpp.llama_vocab_is_eog(m.vocab, t) for t in first)
        m.detokenize(first).decode("utf-8")


def test_qwen2_architecture_small_model_loads(tmp_path):
    """The qwen2 path (q/k/v biases, no output.weight) with a tiny size, as a stand-in for 0.5B."""
    shape = dataclasses.replace(
        SHAPES["qwen2.5-0.5b"], name="qwen2-mini", n_layer=2, n_embd=64, n_head=4, n_head_kv=2,
        n_ff=128, n_vocab=1024, n_ctx_train=2048,
    )
    path = write_gguf(shape, tmp_path / "qwen2-mini.gguf")
    with Model(path) as m:
        assert m.meta("general.architecture") == "qwen2"
        assert llama_cpp.llama_model_n_layer(m.ptr) == 2
        assert llama_cpp.llama_model_n_params(m.ptr) == shape.n_params
        assert m.detokenize(m.tokenize("Hello, wörld!")[1:]) == "Hello, wörld!".encode()
        out = greedy(m, "Hello", 16)
        assert min(out) >= synthetic.N_FIXED


# ---- quantization ----


def test_tiny_q8_0_quantizes_into_a_loadable_model(cache):
    calls = []
    path = synthetic_path("tiny:q8_0", progress=lambda d, t: calls.append((d, t)))
    assert path == cache / "synthetic-tiny-q8_0.gguf"
    assert (cache / "synthetic-tiny-f16.gguf").is_file()
    assert calls[-1][0] == calls[-1][1]
    assert path.stat().st_size < (cache / "synthetic-tiny-f16.gguf").stat().st_size
    with Model(path) as m:
        assert m.meta("general.file_type") == str(llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0)
        assert llama_cpp.llama_model_n_layer(m.ptr) == 2
        assert llama_cpp.llama_model_n_embd(m.ptr) == 64
        assert len(set(greedy(m, "Hello", 16))) > 1
    mtime = path.stat().st_mtime_ns
    assert synthetic_path("tiny:q8_0") == path and path.stat().st_mtime_ns == mtime


def test_tiny_q4_k_m_quantizes_into_a_loadable_model():
    with Model(synthetic_path("tiny:q4_k_m")) as m:
        assert m.meta("general.file_type") == str(llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M)


def test_quantize_failure_is_model_load_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError):
        synthetic.quantize(bad, tmp_path / "out.gguf", "q8_0")


# ---- concurrency and crashes ----


def test_concurrent_callers_share_one_file(cache):
    results, errors = [], []

    def worker():
        try:
            results.append(synthetic_path("tiny:q8_0"))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert sorted(p.name for p in cache.glob("*.gguf")) == ["synthetic-tiny-f16.gguf", "synthetic-tiny-q8_0.gguf"]
    assert not list(cache.glob(".*.tmp"))
    with Model(results[0]):
        pass


def test_crash_while_writing_leaves_no_file(cache, monkeypatch):
    real = synthetic._tensor_chunks  # the writer's one seam for a fault mid-file

    def failing(shape, t, index):
        if index == 3:
            raise RuntimeError("disk on fire")
        yield from real(shape, t, index)

    monkeypatch.setattr(synthetic, "_tensor_chunks", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        synthetic_path("tiny")
    assert not list(cache.glob("*.gguf")) and not list(cache.glob(".*.tmp"))

    # a stale temp file of a killed writer is cleaned up by the next writer
    (cache / ".synthetic-tiny-f16.gguf.99999.tmp").write_bytes(b"partial")
    monkeypatch.setattr(synthetic, "_tensor_chunks", real)
    path = synthetic_path("tiny")
    assert path.is_file() and not list(cache.glob(".*.tmp"))
    with Model(path):
        pass
