"""Structured output and tool calls through the official `openai` client, against a live
`tandem serve` on the default model (SmolLM2-135M-Instruct): whatever so small a model would
write, the grammar sampler makes the reply valid JSON that matches the schema.

Replies are greedy (temperature 0) and the schemas small, so each reply is a few dozen tokens;
every wait is bounded. The pure parts (the tool-call format, the history polyfills)
are tested without a model at the end.
"""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field
from servers import Server

from engine.core.errors import InvalidRequest
from engine.llama.grammar import schema_grammar
from engine.prompts.tool_calls import JSON_FORMAT, TemplateCaps, ToolMode, history, read_reply, reply_grammar

WAIT = 600  # seconds for one reply: a loaded two-core test machine decodes ~1 token/s
SPEC = "cpu:threads=1,cap=4,ctx=2048"


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int


class Weather(BaseModel):
    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


class Reminder(BaseModel):
    text: str = Field(max_length=40)
    minutes: int


def tool(name: str, description: str, params: type[BaseModel]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": params.model_json_schema()}}


TOOLS = [tool("get_weather", "Get the current weather in a city", Weather),
         tool("set_reminder", "Remind the user of something in some minutes", Reminder)]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    s = Server("--model", "default", "--backend", SPEC, "--no-calibrate")  # one backend: nothing to route
    try:
        yield s.wait_healthy()
    finally:
        s.close()


@pytest.fixture
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT)
    yield c
    c.close()


# ---- response_format ----


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client):
    completion = client.beta.chat.completions.parse(
        model="default", temperature=0, response_format=Person,
        messages=[{"role": "user", "content": "Invent a person: a name and an age."}])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Person)


def test_json_object_reply_is_a_json_object(client):
    r = client.chat.completions.create(
        model="default", temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}])
    assert r.choices[0].finish_reason == "stop", r
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_schema_the_converter_refuses_is_a_400_with_its_reason(client):
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "frobnicate"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=ASK_WEATHER, response_format=bad)
    err = e.value.body
    assert err["param"] == "response_format"
    assert "Unrecognized schema" in err["message"], err


def test_a_tool_schema_the_converter_refuses_is_a_400_naming_the_tool(client):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                         "properties": {"x": {"$ref": "#/nowhere"}}}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=ASK_WEATHER, tools=bad)
    assert e.value.body["param"] == "tools[0].function.parameters", e.value.body


def test_a_gbnf_grammar_constrains_a_completion(client):
    r = client.completions.create(model="default", prompt="Is the sky blue? Answer:", temperature=0,
                                  extra_body={"grammar": 'root ::= " yes" | " no"'})
    assert r.choices[0].text in (" yes", " no")
    assert r.choices[0].finish_reason == "stop"


# ---- tools ----


def test_required_tool_call_arguments_validate_against_the_function_schema(client):
    r = client.chat.completions.create(model="default", temperature=0, messages=ASK_WEATHER, tools=TOOLS,
                                       tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    params = {"get_weather": Weather, "set_reminder": Reminder}[call.function.name]
    params.model_validate_json(call.function.arguments)  # raises if the arguments do not validate


def test_a_named_tool_choice_calls_that_function(client):
    r = client.chat.completions.create(model="default", temperature=0, messages=ASK_WEATHER, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "set_reminder"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "set_reminder"
    Reminder.model_validate_json(call.function.arguments)


def test_a_streamed_tool_call_arrives_in_openai_delta_shape(client):
    stream = client.chat.completions.create(model="default", temperature=0, messages=ASK_WEATHER,
                                            tools=TOOLS[:1], tool_choice="required", stream=True)
    name, call_id, arguments, finish = None, None, "", None
    for chunk in stream:
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or ():
            call_id = d.id or call_id
            name = (d.function.name if d.function and d.function.name else None) or name
            arguments += (d.function.arguments or "") if d.function else ""
        finish = choice.finish_reason or finish
    assert (name, finish) == ("get_weather", "tool_calls")
    assert call_id and call_id.startswith("call_")
    Weather.model_validate_json(arguments)


def test_a_history_holding_a_tool_call_with_its_result_is_accepted(client):
    messages = [*ASK_WEATHER,
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather",
                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model="default", temperature=0, messages=messages, tools=TOOLS,
                                       max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 0


def test_a_named_tool_choice_outside_the_tools_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=ASK_WEATHER, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"


# ---- the call format, without a model ----


def test_required_among_several_has_no_answer_branch():
    args = schema_grammar(Weather.model_json_schema())
    grammar = reply_grammar(ToolMode("required", ("get_weather", "set_reminder")),
                            {"get_weather": args, "set_reminder": args})
    assert "response" not in grammar
    assert '"get_weather\\",\\"arguments\\":"' in grammar  # after the prompt's {"name":"


def test_a_named_choice_grammar_holds_only_that_functions_arguments():
    mode = ToolMode("set_reminder", ("get_weather", "set_reminder"), named=True)
    grammar = reply_grammar(mode, {"set_reminder": schema_grammar(Reminder.model_json_schema())})
    assert "tandem-f1" not in grammar and "get_weather" not in grammar
    assert mode.prefill == '{"name": "set_reminder", "arguments": '


def test_an_auto_reply_with_a_response_is_content():
    assert read_reply('response":"hello"}', ToolMode("auto", ("get_weather",))) == ("hello", [])


def test_a_reply_with_a_call_gives_json_string_arguments():
    _, calls = read_reply('name":"get_weather","arguments":{"city":"Oslo"}}', ToolMode("auto", ("get_weather",)))
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}


def test_a_cut_reply_is_not_read_as_a_call():
    assert read_reply('{"ci', ToolMode("required", ("get_weather",))) == (None, [])


def test_history_tool_calls_become_content_where_the_template_cannot_render_them():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    out = history([{"role": "assistant", "content": "", "tool_calls": [call]}], TemplateCaps(), JSON_FORMAT)
    assert json.loads(out[0]["content"]) == {"name": "get_weather", "arguments": {"city": "Oslo"}}


def test_history_tool_results_become_user_turns_where_the_template_drops_them():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    out = history([{"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}], TemplateCaps(tool_calls=True),
                  JSON_FORMAT)
    assert out[1]["role"] == "user"
    assert json.loads(out[1]["content"])["tool_response"]["tool"] == "get_weather"


def test_a_bound_the_converter_would_expand_enormously_is_refused():
    with pytest.raises(InvalidRequest, match="minItems"):
        schema_grammar({"type": "array", "minItems": 10**9})


def test_strings_in_a_schema_grammar_exclude_control_characters():
    grammar = schema_grammar({"type": "string"})
    assert "\\x00-\\x1F" in grammar
