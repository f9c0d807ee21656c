"""Embeddings from the loaded model: a small llama.cpp context of its own that outputs one
pooled vector per sequence.

A generation context cannot share the work: llama.cpp's embedding output is a per-context
switch (`llama_set_embeddings`) with the pooling fixed when the context is made, and a pooled
batch must output every one of its tokens, so generating sequences in the same batch would
compute logits for all their rows. So a backend's worker thread owns one `Embedder` beside its
generation context (made on the first embedding request, freed with the backend), and runs its
decodes between two generation steps. Weights are shared; its KV (`EMBED_CTX` cells, the
longest input it takes) is cleared after every decode.

Pooling is the model's own where its GGUF names one (`<arch>.pooling_type`: an embedding
model's CLS or mean), else mean pooling over the input's tokens (a generative model names
none), as llama-server's `--pooling mean`. A reranking head (`rank`) gives scores, not
embeddings, and is refused. Vectors are L2-normalised, as OpenAI's and llama-server's are.

Thread contract: one thread (the backend's worker) makes, uses and frees an `Embedder`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

from engine.core.errors import BackendUnavailable, ContextLengthExceeded, EngineError, InvalidRequest, RequestFailed

from . import lc
from .batch import Batch
from .model import Model

EMBED_CTX = 2048  # tokens of the longest input (and of one decode), at most the training context
EMBED_SEQS = 16  # inputs packed into one decode
_POOLING = {"none": lc.LLAMA_POOLING_TYPE_NONE, "mean": lc.LLAMA_POOLING_TYPE_MEAN,
            "cls": lc.LLAMA_POOLING_TYPE_CLS, "last": lc.LLAMA_POOLING_TYPE_LAST,
            "rank": lc.LLAMA_POOLING_TYPE_RANK}
_NAMES = {v: k for k, v in _POOLING.items()}


def model_pooling(model: Model) -> int:
    """The pooling the GGUF names (`<arch>.pooling_type`), or mean where it names none."""
    arch = _meta(model, "general.architecture")
    value = _meta(model, f"{arch}.pooling_type") if arch else ""
    try:
        pooling = int(value)
    except ValueError:
        return lc.LLAMA_POOLING_TYPE_MEAN
    return lc.LLAMA_POOLING_TYPE_MEAN if pooling in (lc.LLAMA_POOLING_TYPE_NONE, -1) else pooling


def _meta(model: Model, key: str) -> str:
    buf = ctypes.create_string_buffer(256)
    n = lc.llama_model_meta_val_str(model.ptr, key.encode(), buf, 256)
    return buf.value.decode("utf-8", "replace") if n > 0 else ""


class Embedder:
    """A pooled-embedding context on `model` (worker thread only)."""

    def __init__(self, model: Model, threads: int, threads_batch: int, name: str):
        self.model = model
        self.pooling = model_pooling(model)
        if self.pooling == lc.LLAMA_POOLING_TYPE_RANK:
            raise InvalidRequest("this model is a reranker (its pooling is `rank`): it scores pairs, it does not "
                                 "make embeddings", param="model")
        train = model.n_ctx_train
        self.n_ctx = min(EMBED_CTX, train) if train > 0 else EMBED_CTX
        p = lc.llama_context_default_params()
        p.n_ctx = self.n_ctx
        p.n_batch = p.n_ubatch = self.n_ctx  # a pooled sequence must sit in one micro-batch
        p.n_seq_max = EMBED_SEQS
        p.n_threads, p.n_threads_batch = threads, threads_batch
        p.kv_unified = True  # any input may take the whole context
        p.embeddings = True
        p.pooling_type = self.pooling
        p.no_perf = True
        if model.device == "cpu":
            p.offload_kqv = False
            p.op_offload = False
        self.ctx = lc.llama_init_from_model(model.ptr, p)
        if not self.ctx:
            raise BackendUnavailable(f"{name}: llama.cpp could not create an embedding context")
        self.dims = lc.llama_model_n_embd_out(model.ptr) or model.info.n_embd
        self._mem = lc.llama_get_memory(self.ctx)
        self._batch = Batch(self.n_ctx)
        self.decodes = 0  # llama_decode calls so far (any thread may read it)

    @property
    def pooling_name(self) -> str:
        return _NAMES.get(self.pooling, str(self.pooling))

    def check(self, tokens: Sequence[int]) -> None:
        """Raise unless `tokens` is an input this context takes."""
        if not tokens:
            raise InvalidRequest("an input is empty: there is nothing to embed", param="input")
        if len(tokens) > self.n_ctx:
            raise ContextLengthExceeded(len(tokens), self.n_ctx + 1, param="input")
        bad = next((t for t in tokens if not 0 <= t < self.model.n_vocab), None)
        if bad is not None:
            raise InvalidRequest(f"input token id {bad} is not in the model's vocabulary [0, {self.model.n_vocab})",
                                 param="input")

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One L2-normalised float32 vector per input, in order; as few decodes as fit."""
        out: list[np.ndarray] = []
        group: list[Sequence[int]] = []
        used = 0
        for tokens in inputs:
            self.check(tokens)
            if group and (used + len(tokens) > self.n_ctx or len(group) == EMBED_SEQS):
                out += self._decode(group)
                group, used = [], 0
            group.append(tokens)
            used += len(tokens)
        if group:
            out += self._decode(group)
        return out

    def _decode(self, group: list[Sequence[int]]) -> list[np.ndarray]:
        batch = self._batch
        batch.clear()
        for seq, tokens in enumerate(group):
            batch.add(list(tokens), seq, 0, True, want_all=True)  # pooling reads every token's output
        try:
            self.decodes += 1
            rc = lc.llama_decode(self.ctx, batch.full())
            if rc != 0:
                raise RequestFailed(f"llama_decode returned {rc} while embedding {len(group)} inputs")
            vectors = []
            for seq in range(len(group)):
                ptr = lc.llama_get_embeddings_seq(self.ctx, seq)
                if not ptr:
                    raise RequestFailed("llama.cpp returned no pooled embedding")
                v = np.ctypeslib.as_array(ptr, shape=(self.dims,)).astype(np.float32)
                norm = float(np.linalg.norm(v))
                vectors.append(v / norm if norm > 0 else v)
            return vectors
        finally:
            lc.llama_memory_clear(self._mem, True)

    def close(self) -> None:
        if self.ctx:
            lc.llama_free(self.ctx)
            self.ctx = None


class Embeddings:
    """A backend worker's embedding work: its `Embedder`, made on the first request and kept
    until `close`; `run` answers the requests taken between two steps together (worker thread)."""

    def __init__(self, model: Model, threads: int, threads_batch: int, name: str):
        self._args = (model, threads, threads_batch, name)
        self._embedder: Embedder | None = None

    @property
    def decodes(self) -> int:
        """Decodes the embedding context ran (requests taken together share them); any thread."""
        e = self._embedder
        return e.decodes if e is not None else 0

    def run(self, requests: Sequence[tuple[Sequence[Sequence[int]], Future]]) -> None:
        """Each request's vectors into its future, in as few decodes as fit; a request with an
        input the context cannot take fails alone."""
        try:
            if self._embedder is None:
                self._embedder = Embedder(*self._args)
        except EngineError as e:
            for _, future in requests:
                future.set_exception(e)
            return
        embedder = self._embedder
        good = []
        for inputs, future in requests:
            try:
                for tokens in inputs:
                    embedder.check(tokens)
                good.append((inputs, future))
            except EngineError as e:
                future.set_exception(e)
        try:
            vectors = embedder.embed([t for inputs, _ in good for t in inputs])
        except EngineError as e:
            for _, future in good:
                future.set_exception(e)
            return
        at = 0
        for inputs, future in good:
            future.set_result(vectors[at:at + len(inputs)])
            at += len(inputs)

    def close(self) -> None:
        if self._embedder is not None:
            self._embedder.close()
            self._embedder = None
