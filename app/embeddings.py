"""`POST /v1/embeddings`: OpenAI's embeddings endpoint, computed by the loaded model.

The input is a string, a list of strings, a list of token ids or a list of those (the shapes
OpenAI takes, at most `MAX_INPUTS` inputs). Strings are tokenized with the model's own
vocabulary (with its BOS, as llama-server does), so token ids must be this model's: a client
that tokenizes with tiktoken first (LangChain's `OpenAIEmbeddings` does unless
`check_embedding_ctx_length=False`) sends ids from another vocabulary, refused where they fall
outside this one. The request is routed like any other (`Engine.embed`: the decision's kind
is `embedding`) and the chosen backend batches it with what else it has
(engine/llama/embedding.py: the model's pooling, mean where the GGUF names none; vectors
L2-normalised). `encoding_format` is `float` or `base64` (little-endian float32, what the
openai SDK asks for by default); `dimensions` other than the model's own is refused, since a
model not trained for shortened vectors loses their meaning when they are cut.

Thread contract: `parse` runs on a worker thread (it tokenizes); the handler on the loop.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from aiohttp import web
from pydantic import Field

from engine.core.errors import InvalidRequest

from .http_guard import parse_body
from .openai_schema import ServedModel, _Strict, validate
from .settings import ENGINE, SETTINGS

if TYPE_CHECKING:
    from engine.engine import Engine

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class EmbeddingRequest(_Strict):
    input: (Annotated[str, Field(min_length=1)] | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]
            | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]) = Field(
        description="a string, a list of strings, token ids, or a list of token-id lists")
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    backend: str | None = Field(default=None, description="extension: pin the request to this backend")


@dataclass(frozen=True)
class EmbeddingCall:
    inputs: list[list[int]]
    model: str
    base64: bool
    backend: str | None


def parse(raw: bytes, engine: Engine, served: ServedModel) -> EmbeddingCall:
    """An `/v1/embeddings` body → the token ids to embed (raises `InvalidRequest`)."""
    body = validate(EmbeddingRequest, raw)
    model = served.canonical(served.check(body.model))
    if engine.model is None:
        raise InvalidRequest("this server routes to remote engines only and has no model of its own to embed "
                             "with; ask an engine's /v1/embeddings", param="model")
    dims = engine.model.info.n_embd
    if body.dimensions is not None and body.dimensions != dims:
        raise InvalidRequest(f"dimensions={body.dimensions} is not supported: this model's embeddings have {dims} "
                             f"dimensions and it was not trained for shortened ones (send {dims}, or leave "
                             f"dimensions out)", param="dimensions")
    raw_inputs: list = body.input if isinstance(body.input, list) and not isinstance(body.input[0], int) \
        else [body.input]
    inputs = []
    for i, item in enumerate(raw_inputs):
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(f"input[{i}] is empty: there is nothing to embed", param="input")
            tokens = engine.prompt_tokens(item, param="input")
        else:
            tokens = [int(t) for t in item]
            bad = next((t for t in tokens if t >= engine.model.n_vocab), None)
            if bad is not None:
                raise InvalidRequest(f"input[{i}]: token id {bad} is not in this model's vocabulary [0, "
                                     f"{engine.model.n_vocab}) (token ids must be this model's, not tiktoken's)",
                                     param="input")
        inputs.append(tokens)
    return EmbeddingCall(inputs, model, body.encoding_format == "base64", body.backend)


async def create(request: web.Request) -> web.Response:
    """`POST /v1/embeddings`: OpenAI's list of embedding objects, with usage."""
    app = request.app
    call = await parse_body(request, parse, app[ENGINE], app[SETTINGS].served)
    future, decision = app[ENGINE].embed(call.inputs, backend=call.backend)
    vectors = await asyncio.wrap_future(future)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, call.base64)} for i, v in enumerate(vectors)]
    n = sum(len(t) for t in call.inputs)
    return web.json_response({"object": "list", "data": data, "model": call.model,
                              "usage": {"prompt_tokens": n, "total_tokens": n}},
                             headers={"X-Request-Id": decision.request_id, "X-Tandem-Backend": decision.backend})


def _encoded(vector: np.ndarray, as_base64: bool) -> list[float] | str:
    if as_base64:
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(float).tolist()


def document(doc: dict, *, auth: bool) -> None:
    """Add the route and `EmbeddingRequest` to the server's OpenAPI document `doc`."""
    schemas = doc["components"]["schemas"]
    schema = EmbeddingRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    schemas["EmbeddingRequest"] = schema
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    op: dict[str, Any] = {"summary": "embeddings of the inputs (OpenAI's embeddings API)",
          "requestBody": {"required": True, "content": {"application/json": {
              "schema": {"$ref": "#/components/schemas/EmbeddingRequest"}}}},
          "responses": {"200": {"description": "the embeddings", "content": {"application/json": {
              "schema": {"type": "object", "required": ["object", "data", "model", "usage"]}}}},
              "400": {"description": "invalid request", **error}, "404": {"description": "unknown model", **error},
              "503": {"description": "no backend can serve", **error}}}
    if auth:
        op["security"] = [{"bearer": []}]
    doc["paths"]["/v1/embeddings"] = {"post": op}


ROUTES = [web.post("/v1/embeddings", create)]
