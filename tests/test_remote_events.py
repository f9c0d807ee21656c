"""A remote engine's stream events as the client reads them: the text, the finish reason and the
usage of a well-formed event, and the first field that is not what OpenAI's API says it is."""

from __future__ import annotations

import pytest

from engine.backends.remote.client import EngineMisbehaved, parse_event


@pytest.mark.parametrize(("event", "chat", "parsed"), [
    ({"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]}, True, (["Hi"], None, None, None)),
    ({"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": {"completion_tokens": 3}}, True,
     ([], "stop", {"completion_tokens": 3}, None)),
    ({"choices": [{"text": "a"}, {"text": "b", "finish_reason": "length"}]}, False, (["a", "b"], "length", None, None)),
    ({"choices": None, "usage": {}}, True, ([], None, None, None)),  # an empty usage reads as none
    ({"choices": [{"delta": None, "finish_reason": None}]}, True, ([], None, None, None)),
    ({"error": {"message": "overloaded"}}, True, ([], None, None, {"error": {"message": "overloaded"}})),
])
def test_a_well_formed_event_is_read_field_by_field(event, chat, parsed):
    assert parse_event(event, chat) == parsed


@pytest.mark.parametrize(("event", "chat", "message"), [
    ([], True, "an event that is a list, not an object"),
    ({"usage": 3}, True, "usage is an integer, not an object"),
    ({"choices": {}}, True, "choices is an object, not a list"),
    ({"choices": ["x"]}, True, "a choice is a string, not an object"),
    ({"choices": [{"delta": "x"}]}, True, "choices[].delta is a string, not an object"),
    ({"choices": [{"delta": {"content": 5}}]}, True, "choices[].delta.content is an integer, not a string"),
    ({"choices": [{"text": ["x"]}]}, False, "choices[].text is a list, not a string"),
    ({"choices": [{"text": "a", "finish_reason": "x" * 65}]}, False,
     "choices[].finish_reason is a string, not a short string"),
    ({"choices": [{"text": "a", "finish_reason": 1}]}, False, "choices[].finish_reason is an integer, not a short string"),
])
def test_a_malformed_event_names_its_first_bad_field(event, chat, message):
    with pytest.raises(EngineMisbehaved) as e:
        parse_event(event, chat)
    assert str(e.value) == message
