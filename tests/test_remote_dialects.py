"""Each engine kind's dialect (engine/backends/remote/dialects.py): the fields its requests carry,
what it refuses, how it is told apart; and the spec table every backend kind registers in.

Pure: no engine runs here (tests/test_remote.py and tests/test_hostile_engine.py drive real ones).
"""

from __future__ import annotations

import asyncio

import pytest

from engine.backends.config import parse_backend_spec
from engine.backends.registry import SPEC_KINDS
from engine.backends.remote.config import APIS
from engine.backends.remote.dialects import DETECTED, DIALECTS, GENERIC, dialect
from engine.backends.remote.probe import MAX_EXTERNAL, Load
from engine.core.errors import InvalidRequest
from engine.core.request import Request, SamplingParams

KNOBS = SamplingParams(max_tokens=20, temperature=0.5, top_k=7, min_p=0.1, repeat_penalty=1.2, repeat_last_n=32,
                       ignore_eos=True, seed=3, stop=("END",))
CHAT = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"})


def chat(sampling: SamplingParams = KNOBS) -> Request:
    return Request((), sampling, messages=CHAT, continue_final=True)


def test_every_api_a_spec_may_name_has_a_dialect():
    assert set(APIS) == set(DIALECTS)


@pytest.mark.parametrize(("api", "fields"), [
    ("openai", {}),
    ("tandem", {"top_k": 7, "min_p": 0.1, "repeat_penalty": 1.2, "repeat_last_n": 32, "ignore_eos": True}),
    ("llama-server", {"top_k": 7, "min_p": 0.1, "repeat_penalty": 1.2, "repeat_last_n": 32, "ignore_eos": True,
                      "cache_prompt": True}),
    ("vllm", {"top_k": 7, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True}),
    ("sglang", {"top_k": 7, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True}),
])
def test_a_completion_carries_openai_s_fields_plus_the_dialect_s_own(api, fields):
    body = dialect(api).body(Request((), KNOBS, text="Once"), chat=False, model="m")
    common = {"stream": True, "stream_options": {"include_usage": True}, "temperature": 0.5, "top_p": KNOBS.top_p,
              "max_tokens": 20, "model": "m", "prompt": "Once", "stop": ["END"], "seed": 3}
    assert body == common | fields


@pytest.mark.parametrize(("api", "fields"), [
    ("tandem", {"continue_final_message": True}),
    ("llama-server", {}),  # it continues a final assistant message by itself
    ("vllm", {"continue_final_message": True, "add_generation_prompt": False}),
    ("sglang", {"continue_final_message": True}),
])
def test_a_continued_chat_asks_each_engine_in_its_own_words(api, fields):
    body = dialect(api).body(chat(), chat=True, model="")
    assert body["messages"] == list(CHAT) and "model" not in body
    assert {k: body[k] for k in ("continue_final_message", "add_generation_prompt") if k in body} == fields


def test_a_generic_api_refuses_a_continued_chat():
    with pytest.raises(InvalidRequest, match="continuing the final assistant message"):
        GENERIC.check("e", chat())


@pytest.mark.parametrize("api", ["openai", "vllm", "sglang"])
def test_an_engine_without_gbnf_refuses_a_grammar(api):
    with pytest.raises(InvalidRequest, match="grammar-constrained"):
        dialect(api).check("e", Request((), SamplingParams(grammar='root ::= "a"'), text="x"))


@pytest.mark.parametrize("api", ["tandem", "llama-server", "auto"])
def test_a_gbnf_engine_takes_a_grammar(api):
    req = Request((), SamplingParams(grammar='root ::= "a"'), text="x")
    dialect(api).check("e", req)
    assert dialect(api).body(req, chat=False, model="")["grammar"] == 'root ::= "a"'


ANSWERS = {
    "tandem": {"/v1/routing?n=0": (200, {"backends": []})},
    "llama-server": {"/props": (200, {"default_generation_settings": {}})},
    "vllm": {"/metrics": (200, "vllm:num_requests_running 0\n")},
    "sglang": {"/metrics": (200, "sglang:num_running_reqs 0\n")},
}


@pytest.mark.parametrize("api", list(ANSWERS))
def test_each_engine_is_told_apart_by_its_own_endpoints(api):
    async def get(path: str):
        return ANSWERS[api].get(path, (404, "not found"))

    found = [d.name for d in DETECTED if asyncio.run(d.identify(get))]
    assert found == [api]


def test_an_engine_s_load_report_is_clamped():
    load = Load.reported(1e11, -5, list(range(10 * MAX_EXTERNAL)))
    assert (load.running, load.waiting, len(load.decode_left)) == (MAX_EXTERNAL, 0, MAX_EXTERNAL)
    assert load.decode_left[0] == 10 * MAX_EXTERNAL - 1  # the longest budgets are kept


# ---- the spec table ----


def test_every_kind_registers_its_spec_prefixes():
    assert {"cpu", "gpu", "auto", "remote", "null"} <= set(SPEC_KINDS)
    assert type(parse_backend_spec("null:name=n")).__name__ == "NullConfig"
    assert type(parse_backend_spec("remote:url=http://h:1")).__name__ == "RemoteConfig"
    assert type(parse_backend_spec("gpu:cap=4")).__name__ == "BackendConfig"


def test_an_unknown_kind_is_refused_naming_the_known_ones():
    with pytest.raises(InvalidRequest, match="auto, cpu, gpu, null, remote"):
        parse_backend_spec("tpu:cap=4")
