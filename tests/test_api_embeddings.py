"""`POST /v1/embeddings` against a live `tandem serve --model default` (SmolLM2-135M-Instruct,
mean pooling): through the openai SDK (base64, its default, and float), LangChain's
`OpenAIEmbeddings` as a user configures it offline, and plain HTTP for token ids, the refusals
and the routing record. Batching and routing run on an engine served in this process, whose
worker a test holds at a step boundary. Every wait is bounded."""

from __future__ import annotations

import threading

import httpx2 as httpx
import numpy as np
import pytest
import ui_fixtures  # noqa: F401  (Qt offscreen, for the routing table's model)
from langchain_openai import OpenAIEmbeddings
from test_server import LoopThread

from app.server import create_app
from engine.backends.config import parse_backend_specs
from engine.engine import Engine

SPEC = "cpu:threads=2,cap=2,ctx=2048"
TIMEOUT = 300
CAT, PARAPHRASE, UNRELATED = "The cat sat on the mat.", "A cat was sitting on the rug.", "The stock market fell today."


def post(server, body: dict, path: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=TIMEOUT)


def cosine(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


# ---- clients ----


def test_the_sdk_gets_one_unit_vector_per_input_in_order(client):
    r = client.embeddings.create(model="default", input=[CAT, PARAPHRASE, UNRELATED])  # base64 on the wire
    assert [d.index for d in r.data] == [0, 1, 2] and r.object == "list"
    vectors = np.array([d.embedding for d in r.data])
    assert vectors.shape == (3, 576)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-4)
    assert r.usage.prompt_tokens == r.usage.total_tokens > 3
    assert r.model == client.models.retrieve("default").id


def test_base64_gives_the_float_vector(client):
    floats = client.embeddings.create(model="default", input=CAT, encoding_format="float").data[0].embedding
    packed = client.embeddings.create(model="default", input=CAT).data[0].embedding
    assert np.allclose(floats, packed, atol=1e-6)


def test_langchain_ranks_a_paraphrase_above_an_unrelated_sentence(server):
    # Offline, as a user points it at a local server: no tiktoken download, strings sent as they are.
    embeddings = OpenAIEmbeddings(base_url=server.url + "/v1", api_key="unused", model="default",
                                  check_embedding_ctx_length=False, max_retries=0, timeout=TIMEOUT)
    cat, paraphrase, unrelated = embeddings.embed_documents([CAT, PARAPHRASE, UNRELATED])
    assert cosine(cat, paraphrase) > cosine(cat, unrelated) + 0.1
    query = embeddings.embed_query("Where is the cat sitting?")
    assert cosine(query, cat) > cosine(query, unrelated)


def test_token_ids_embed_as_the_same_text_does(client, server):
    ids = httpx.post(server.url + "/tokenize", json={"content": CAT, "add_special": True}, timeout=TIMEOUT).json()
    by_ids = post(server, {"input": ids["tokens"], "encoding_format": "float"}).json()["data"][0]["embedding"]
    by_text = client.embeddings.create(model="default", input=CAT, encoding_format="float").data[0].embedding
    assert np.allclose(by_ids, by_text, atol=1e-5)


def test_a_list_of_token_id_lists_gets_one_vector_each(server):
    r = post(server, {"input": [[1, 2, 3], [4, 5]]}).json()
    assert [d["index"] for d in r["data"]] == [0, 1] and r["usage"]["prompt_tokens"] == 5


def test_a_batch_gives_what_each_input_gives_alone(client):
    together = client.embeddings.create(model="default", input=[CAT, UNRELATED]).data
    alone = client.embeddings.create(model="default", input=UNRELATED).data[0]
    assert np.allclose(together[1].embedding, alone.embedding, atol=1e-4)


# ---- refusals ----


@pytest.mark.parametrize("body,param,words", [
    ({"input": CAT, "dimensions": 64}, "dimensions", "576 dimensions"),
    ({"input": ""}, "input", "at least 1 character"),
    ({"input": [[1, 2, 10**6]]}, "input", "vocabulary"),
    ({"input": CAT, "encoding_format": "int8"}, "encoding_format", "float"),
])
def test_what_cannot_be_embedded_is_a_400_naming_the_field(server, body, param, words):
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_the_models_own_dimensions_are_accepted(server):
    assert post(server, {"input": CAT, "dimensions": 576}).status_code == 200


def test_an_input_longer_than_the_embedding_context_is_refused(server):
    r = post(server, {"input": [[17] * 5000]})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


# ---- routed and batched ----


def test_an_embedding_is_a_routing_decision_of_its_kind(client, server):
    client.embeddings.create(model="default", input=CAT)
    decision = httpx.get(server.url + "/v1/routing?n=1", timeout=TIMEOUT).json()["decisions"][-1]
    assert decision["kind"] == "embedding" and decision["backend"] == "cpu"
    assert decision["scores"][0]["prefill_tokens"] > 0


@pytest.fixture
def two_backends():
    loop = LoopThread()
    try:
        with Engine.load("default", parse_backend_specs(["cpu:threads=1,cap=2,ctx=1024",
                                                         "cpu:threads=1,cap=2,ctx=1024"])) as eng, \
                loop.serving(create_app(eng)) as base:
            yield eng, base
    finally:
        loop.close()


def test_embedding_requests_taken_together_share_one_decode(two_backends):
    eng, _ = two_backends
    name, backend = next(iter(eng.backends.items()))
    tokens = [eng.model.tokenize(t) for t in (CAT, UNRELATED)]
    gate, held = threading.Event(), threading.Event()
    try:
        blocker = backend.call(lambda b: (held.set(), gate.wait(TIMEOUT)))  # the worker holds between steps
        assert held.wait(TIMEOUT)
        futures = [eng.embed([t], backend=name)[0] for t in tokens]  # both posted while it holds
    finally:
        gate.set()
    blocker.result(TIMEOUT)
    first, second = (f.result(TIMEOUT) for f in futures)
    assert len(first) == len(second) == 1
    assert backend.embedding_decodes == 1
    alone = eng.embed([tokens[1]], backend=name)[0].result(TIMEOUT)
    assert np.allclose(second[0], alone[0], atol=1e-4) and backend.embedding_decodes == 2


def test_embeddings_are_routed_among_the_backends(two_backends):
    eng, base = two_backends
    r = httpx.post(base + "/v1/embeddings", json={"input": [CAT, PARAPHRASE]}, timeout=TIMEOUT)
    assert r.status_code == 200
    (decision,) = [d for d in eng.router.recent() if d.kind == "embedding"]
    assert {s.name for s in decision.scores} == set(eng.backends) and decision.backend == r.headers["X-Tandem-Backend"]


def test_the_routing_table_shows_an_embedding_as_such(qapp, two_backends):
    from ui.routing import RoutingTableModel

    eng, base = two_backends
    httpx.post(base + "/v1/embeddings", json={"input": CAT}, timeout=TIMEOUT).raise_for_status()
    model = RoutingTableModel(list(eng.backends))
    model.add(eng.router.recent()[-1])
    assert "embedding" in model.data(model.index(0, 2))
