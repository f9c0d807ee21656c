"""Tool calls that fit and stream, through the official `openai` client and LangChain against a
live `tandem serve` on the default model (SmolLM2-135M-Instruct): a call with short arguments
comes back as a call at max_tokens 16, 24 and 32 under every tool_choice, with its tokens counted
in the usage; with tools sent, a text answer streams token by token and a call's arguments come
in pieces; after a tool round trip, a turn where no tool may be called holds no call wrapper.
The format and its reader are tested without a model first. Replies are greedy unless a seed
says otherwise; every wait is bounded."""

from __future__ import annotations

import json

import httpx2 as httpx
import openai
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from engine.llama.grammar import schema_grammar
from engine.prompts.reply import read_whole
from engine.prompts.tool_calls import (
    HERMES_FORMAT,
    JSON_FORMAT,
    ArgumentsDelta,
    CallStart,
    TemplateCaps,
    TextDelta,
    ToolMode,
    ToolReplyReader,
    history,
    json_string_prefix,
    read_reply,
    reply_grammar,
    tool_format,
)

# flash_attn=on: a greedy reply does not move with what shares its batch or with a cache hit
SPEC = "cpu:threads=2,cap=4,ctx=2048,flash_attn=on"
TIMEOUT = 300  # seconds for one reply on a loaded two-core machine
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
REMINDER = {"type": "function", "function": {
    "name": "set_reminder", "description": "Remind the user of something in some minutes",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}, "minutes": {"type": "integer"}},
                   "required": ["text", "minutes"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CHOICES = {"auto": "auto", "required": "required",
           "named": {"type": "function", "function": {"name": "get_weather"}}}


# ---- the format, without a model ----


def feed_all(mode: ToolMode, pieces: list[str]) -> tuple[list, tuple]:
    reader = ToolReplyReader(mode)
    events = [e for p in pieces for e in reader.feed(p)]
    return events, reader.finish()


def test_an_auto_prompt_ends_with_the_json_objects_opening():
    assert ToolMode("auto", ("get_weather",)).prefill == '{"'


def test_a_known_functions_prompt_holds_its_whole_head():
    assert ToolMode("get_weather", ("get_weather", "x"), named=True).prefill == '{"name": "get_weather", "arguments": '
    assert ToolMode("required", ("get_weather",)).prefill == '{"name": "get_weather", "arguments": '


def test_a_call_streams_its_name_then_its_arguments_in_pieces():
    pieces = ["name", '":"', "get", "_weather", '","', "arguments", '":', '{"', "city", '":"', "Paris", '"', "}}"]
    events, (content, calls) = feed_all(ToolMode("auto", ("get_weather",)), pieces)
    assert isinstance(events[0], CallStart) and events[0].name == "get_weather"
    args = [e.text for e in events if isinstance(e, ArgumentsDelta)]
    assert len(args) > 3 and "".join(args) == '{"city":"Paris"}'
    assert content is None and calls[0].arguments == '{"city":"Paris"}' and calls[0].id == events[0].call_id


def test_an_answer_string_is_decoded_as_it_streams():
    pieces = ["response", '":"', "Hel", "lo\\", "n", "caf\\u00", "e9 \\ud83d", "\\ude00", '"}']
    events, (content, calls) = feed_all(ToolMode("auto", ("get_weather",)), pieces)
    assert [e.text for e in events] == ["Hel", "lo", "\n", "caf", "é ", "😀"]
    assert (content, calls) == ("Hello\ncafé 😀", [])


def test_a_call_cut_short_is_nothing():
    assert read_reply('name":"get_weather","arguments":{"ci', ToolMode("auto", ("get_weather",))) == (None, [])
    assert read_reply('name":"get_wea', ToolMode("auto", ("get_weather",))) == (None, [])


def test_a_template_with_tool_call_tags_keeps_its_own_call_format():
    assert tool_format("{% if tools %}<tool_call>{% endif %}") is HERMES_FORMAT
    assert tool_format("{{ messages }}") is JSON_FORMAT
    assert ToolMode("auto", ("get_weather",), format=HERMES_FORMAT).prefill == ""


def test_a_hermes_call_is_read_after_its_opener():
    mode = ToolMode("auto", ("get_weather",), format=HERMES_FORMAT)
    _, (_, calls) = feed_all(mode, ["<tool", '_call>\n{"name":"get_weather","arguments":{"a":1}}'])
    assert calls[0].name == "get_weather" and calls[0].arguments == '{"a":1}'


def test_a_hermes_text_answer_is_plain_text_as_it_streams():
    events, (content, _) = feed_all(ToolMode("auto", ("get_weather",), format=HERMES_FORMAT), ["Sun", "ny."])
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["Sun", "ny."] and content == "Sunny."


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_the_wrapper_is_compact_where_arguments_take_one_space(choice):
    args = schema_grammar(WEATHER["function"]["parameters"])
    grammar = reply_grammar(ToolMode(choice, ("get_weather", "set_reminder")),
                            {"get_weather": args, "set_reminder": args})
    assert '"get_weather\\",\\"arguments\\":"' in grammar  # the head, with no space in it
    assert 'tandem-f0-space ::= " "?' in grammar  # one space at most, never a newline
    assert "tandem-f1-root" in grammar  # each function's rules kept apart


def test_a_spaced_call_reads_as_a_call():
    mode = ToolMode("get_weather", ("get_weather",), named=True)
    events, (_, calls) = feed_all(mode, ['{"', "city", '":', ' "', "Paris", '"}', " }"])
    assert calls[0].arguments == '{"city": "Paris"}'
    assert "".join(e.text for e in events if isinstance(e, ArgumentsDelta)) == calls[0].arguments


def test_the_json_string_prefix_holds_back_an_escape_cut_short():
    assert json_string_prefix("ab\\u00") == ("ab", 2, False)
    assert json_string_prefix('ab"}') == ("ab", 3, True)


def test_past_calls_are_plain_words_when_no_tool_may_be_called():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    shown = history([{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c1", "content": "21 C"}], TemplateCaps(), None)
    assert shown[0]["content"] == '(I called get_weather(city="Oslo").)'
    assert "{" not in shown[0]["content"] and "tool_calls" not in shown[0]
    assert shown[1] == {"role": "user", "content": "get_weather returned: 21 C"}


def test_past_calls_are_calls_while_a_tool_may_be_called():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    shown = history([{"role": "assistant", "content": None, "tool_calls": [call]}], TemplateCaps(), JSON_FORMAT)
    assert shown[0]["content"] == '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


def test_a_whole_reply_with_a_thinking_block_splits_reasoning_from_the_answer():
    parts = read_whole("<think>It is 2.</think>\n\nTwo.", None, reasoning=True)
    assert (parts.reasoning, parts.content) == ("It is 2.", "Two.")


# ---- through the API ----


@pytest.mark.parametrize("max_tokens", [16, 24, 32])
@pytest.mark.parametrize("choice", list(CHOICES))
def test_a_call_with_short_arguments_fits_small_max_tokens(client, choice, max_tokens):
    r = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], tool_choice=CHOICES[choice],
                                       max_tokens=max_tokens, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    assert 0 < r.usage.completion_tokens <= max_tokens


def test_a_known_functions_call_costs_only_its_arguments(client, server):
    """The head is in the prompt: what is generated is the arguments, a closing brace and the end."""
    r = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], tool_choice="required",
                                       max_tokens=16, temperature=0)
    args = r.choices[0].message.tool_calls[0].function.arguments
    n_args = len(httpx.post(server.url + "/tokenize", json={"content": args}, timeout=TIMEOUT).json()["tokens"])
    assert r.usage.completion_tokens <= n_args + 2, (r.usage, args)


def test_a_streamed_text_answer_with_tools_comes_token_by_token(client):
    stream = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Is it raining in Tokyo?"}], tools=[WEATHER],
        max_tokens=32, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    texts = [d.content for d in deltas if d.content]
    assert len(texts) >= 5, texts
    assert not any(d.tool_calls for d in deltas)
    text = "".join(texts)
    assert not text.lstrip().startswith("{") and "response" not in text, text


def test_a_streamed_call_sends_its_arguments_in_pieces(client):
    stream = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], max_tokens=32,
                                            temperature=0, stream=True)
    calls = [d for c in stream if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    pieces = [d.function.arguments for d in calls[1:]]
    assert len(pieces) >= 3 and all(d.index == 0 for d in calls)
    assert set(json.loads("".join(pieces))) == {"city"}


def test_langchain_bind_tools_gets_its_call_at_max_tokens_24(server):
    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="default", temperature=0, max_tokens=24,
                     max_retries=0, timeout=TIMEOUT)
    message = llm.bind_tools([get_weather]).invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}


ROUND_TRIP = [*ASK,
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21, "sky": "sunny"}'}]


@pytest.mark.parametrize("tools", [{"tools": [WEATHER], "tool_choice": "none"}, {}], ids=["none", "no-tools"])
def test_after_a_round_trip_a_turn_without_tools_holds_no_call_wrapper(client, tools):
    for seed in range(5):
        r = client.chat.completions.create(model="default", messages=ROUND_TRIP, max_tokens=32, seed=seed, **tools)
        content = r.choices[0].message.content
        assert not r.choices[0].message.tool_calls
        wrapper = ('"name"', '"arguments"', "tool_call", '"response"', '{"get_weather"')
        assert not any(w in content for w in wrapper), (seed, content)


def test_a_bad_tool_choice_name_is_still_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"
