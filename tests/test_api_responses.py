"""OpenAI's Responses API through the official `openai` client against a live `tandem serve` on
the default model (SmolLM2-135M-Instruct): plain and streamed (OpenAI's event names, usage),
input as a string or as items (input_text, function_call, function_call_output), function
tools, `text.format`, `responses.parse` with a pydantic model, `previous_response_id` chains
that hit the prefix cache, `store: false`, `GET /v1/responses/{id}`, and the 400s for what is
not supported. Replies are greedy and short; every wait is bounded."""

from __future__ import annotations

import json

import httpx2 as httpx
import openai
import pytest
from pydantic import BaseModel, Field

SPEC = "cpu:threads=1,cap=4,ctx=2048"
TIMEOUT = 600  # seconds for one reply on a loaded two-core machine


class Address(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)


class Person(BaseModel):
    name: str = Field(max_length=24)
    home: Address


WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}



def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json=body, timeout=TIMEOUT)


# ---- plain ----


def test_a_string_input_gets_an_assistant_message_with_its_usage(client):
    r = client.responses.create(model="default", input="Name a colour.", max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_a_reply_cut_by_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model="default", input="Count from one to fifty in words.", max_output_tokens=3,
                                temperature=0)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_instructions_reach_the_prompt(client):
    short = "You are a pirate."
    long = short + " Answer like one, always, in every reply, whatever the question." * 5
    told = [client.responses.create(model="default", input="Hi", max_output_tokens=1, instructions=text)
            for text in (short, long)]
    assert told[1].usage.input_tokens > told[0].usage.input_tokens + 40
    assert told[1].instructions == long


def test_message_items_with_input_text_parts_are_accepted(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]}]
    r = client.responses.create(model="default", input=items, max_output_tokens=4, temperature=0)
    assert r.output_text


# ---- streamed ----


def test_a_stream_sends_openais_events_in_order_with_usage(client):
    events = list(client.responses.create(model="default", input="Name a colour.", max_output_tokens=8,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          kinds[-1]]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas and deltas == done.text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.usage.output_tokens > 0


def test_the_sdks_stream_helper_assembles_the_final_response(client):
    with client.responses.stream(model="default", input="Reply with one word: yes or no. Is snow cold?",
                                 max_output_tokens=60, temperature=0) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text and final.usage.output_tokens > 0


# ---- tools ----


def test_a_function_tool_gives_a_function_call_item(client):
    r = client.responses.create(model="default", input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice="required", temperature=0)
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}


def test_a_streamed_function_call_arrives_as_argument_deltas(client):
    events = list(client.responses.create(model="default", input="What is the weather in Paris?",
                                          tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert set(json.loads(arguments)) == {"city"}
    assert kinds[-1] == "response.completed"
    assert events[-1].response.output[0].arguments == arguments


def test_a_function_call_output_continues_the_conversation(client):
    first = client.responses.create(model="default", input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", temperature=0)
    call = first.output[0]
    r = client.responses.create(
        model="default", previous_response_id=first.id, tools=[WEATHER], tool_choice="none", temperature=0,
        max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'}])
    assert r.output[0].type == "message" and r.output_text
    assert r.previous_response_id == first.id


def test_a_whole_function_call_history_in_the_input_is_accepted(client):
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "21 C and sunny"}]
    r = client.responses.create(model="default", input=items, tools=[WEATHER], max_output_tokens=8, temperature=0)
    assert r.usage.input_tokens > 0 and r.status in ("completed", "incomplete")


# ---- structured output ----


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client):
    r = client.responses.parse(model="default", input="Invent a person: a name and a home city and country.",
                               text_format=Person, temperature=0)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Person)


def test_a_json_object_format_gives_a_json_object(client):
    r = client.responses.create(model="default", input='Reply with the JSON object {"ok": true}.',
                                text={"format": {"type": "json_object"}}, temperature=0)
    assert isinstance(json.loads(r.output_text), dict)
    assert r.text.format.type == "json_object"


# ---- conversations ----


def test_a_previous_response_id_chain_hits_the_prefix_cache(client):
    first = client.responses.create(model="default", input="My name is Ann. Say hello.", max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model="default", previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=8, temperature=0)
    third = client.responses.create(model="default", previous_response_id=second.id, input="Say it again.",
                                    max_output_tokens=8, temperature=0)
    for prev, nxt in ((first, second), (second, third)):
        # the previous prompt and its reply are the next prompt's head, so it is cached
        assert nxt.usage.input_tokens > prev.usage.input_tokens + prev.usage.output_tokens
        assert nxt.usage.input_tokens_details.cached_tokens >= prev.usage.input_tokens


def test_a_stored_response_can_be_retrieved(client):
    r = client.responses.create(model="default", input="Hi", max_output_tokens=2)
    got = client.responses.retrieve(r.id)
    assert (got.id, got.output_text, got.usage.output_tokens) == (r.id, r.output_text, r.usage.output_tokens)


def test_a_streamed_response_is_stored_too(client):
    events = list(client.responses.create(model="default", input="Hi", max_output_tokens=2, stream=True))
    final = events[-1].response
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_store_false_keeps_a_response_out_of_the_store(client):
    r = client.responses.create(model="default", input="Hi", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="default", input="Again", previous_response_id=r.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_a_deleted_response_is_gone(client):
    r = client.responses.create(model="default", input="Hi", max_output_tokens=2)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


# ---- refusals ----


@pytest.mark.parametrize("body,param", [
    ({"input": "Hi", "tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"input": "Hi", "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": "Hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frobnicate"}}}},
     "text.format"),
    ({}, "input"),
])
def test_what_is_not_supported_is_a_400_naming_the_field(server, body, param):
    r = post(server, {"model": "default", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


def test_a_built_in_tool_is_refused_through_the_sdk(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", input="Search the web.", tools=[{"type": "web_search_preview"}])
    assert "web_search_preview" in e.value.message


def test_an_unknown_response_id_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
