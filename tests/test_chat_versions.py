"""A chat's versions without any widget: regenerated answers and edited questions, each with the
turns that followed it, switched, saved and read back; chats saved before versions still load; a
reply joins its chat as a new message, a new version or the rest of a cut reply."""

from __future__ import annotations

import json

import pytest

from ui.model.formatting import token_tip
from ui.model.history import APPEND, Chat, ChatStore, Message, ReplyTo


def contents(chat: Chat) -> list[str]:
    return [m.content for m in chat.messages]


def two_turns() -> Chat:
    return Chat(messages=[Message("user", "q1"), Message("assistant", "a1", {"backend": "cpu0"}),
                          Message("user", "q2"), Message("assistant", "a2")])


def test_an_old_version_keeps_the_turns_that_followed_it():
    chat = two_turns()
    chat.add_version(0, "q1 edited")
    assert contents(chat) == ["q1 edited"]
    m = chat.messages[0]
    assert (m.n_versions, m.shown) == (2, 1)
    chat.messages.append(Message("assistant", "b1"))
    chat.switch(0, 0)
    assert contents(chat) == ["q1", "a1", "q2", "a2"]
    assert chat.messages[1].meta == {"backend": "cpu0"}
    chat.switch(0, 1)
    assert contents(chat) == ["q1 edited", "b1"]


def test_switching_to_the_version_shown_or_out_of_range_changes_nothing():
    chat = two_turns()
    chat.add_version(3, "a2'")
    before = json.dumps(chat.to_dict())
    chat.switch(3, 1)
    chat.switch(3, 5)
    assert json.dumps(chat.to_dict()) == before


def test_a_message_with_one_version_is_saved_without_versions():
    d = two_turns().to_dict()
    assert all("versions" not in m for m in d["messages"])


def test_versions_are_read_back_from_the_saved_file(tmp_path):
    store = ChatStore(tmp_path)
    chat = two_turns()
    chat.add_version(0, "q1 edited")
    chat.messages.append(Message("assistant", "b1"))
    store.save(chat)
    back = store.load(chat.id)
    assert contents(back) == ["q1 edited", "b1"] and back.messages[0].shown == 1
    back.switch(0, 0)
    assert contents(back) == ["q1", "a1", "q2", "a2"]
    back.switch(0, 1)
    assert contents(back) == ["q1 edited", "b1"]


def test_a_chat_saved_with_earlier_answers_loads_them_as_versions():
    d = {"id": "x", "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "third", "meta": {"backend": "cpu1",
                                                            "earlier": [{"content": "second", "backend": "cpu0"},
                                                                        {"content": "first", "backend": "cpu1"}]}}]}
    chat = Chat.from_dict(d)
    m = chat.messages[1]
    assert [v.content for v in m.versions] == ["first", "second", "third"] and m.shown == 2
    assert "earlier" not in m.meta
    chat.switch(1, 1)
    assert m.content == "second" and m.meta == {"backend": "cpu0"}


def test_prompt_messages_upto_leaves_out_the_rest():
    chat = two_turns()
    assert [m["content"] for m in chat.prompt_messages(upto=3)] == ["You are a helpful assistant.", "q1", "a1", "q2"]


def cut_reply() -> Chat:
    """A question and a reply cut by its length limit, with its token probabilities."""
    meta = {"backend": "cpu0", "output_tokens": 2, "finish_reason": "length",
            "logprobs": [["Hel", -0.1, []], ["lo", -0.2, []]]}
    return Chat(messages=[Message("user", "q"), Message("assistant", "Hello", meta)])


@pytest.mark.parametrize("to, texts, versions", [
    (APPEND, ["q", "Hello", "again"], [1, 1, 1]),
    (ReplyTo("version", 1), ["q", "again"], [1, 2]),
    (ReplyTo("continue", 1), ["q", "Hello again"], [1, 1]),
])
def test_a_reply_joins_its_chat_as_it_was_asked_for(to, texts, versions):
    chat = cut_reply()
    chat.take_reply(to, "again" if to.kind != "continue" else " again", {"backend": "cpu1", "output_tokens": 3})
    assert contents(chat) == texts
    assert [m.n_versions for m in chat.messages] == versions
    assert chat.messages[-1].meta["backend"] == "cpu1"


def test_a_continued_reply_merges_its_counts_with_the_earlier_ones():
    chat = cut_reply()
    more = {"backend": "cpu0", "output_tokens": 1, "finish_reason": "stop", "logprobs": [["!", -0.3, []]]}
    meta = chat.take_reply(ReplyTo("continue", 1), "!", more)
    assert meta is chat.messages[1].meta
    assert (meta["output_tokens"], meta["continued"], meta["finish_reason"]) == (3, 1, "stop")
    assert [t[0] for t in meta["logprobs"]] == ["Hel", "lo", "!"]


def test_a_continued_reply_without_probabilities_keeps_the_earlier_ones_once():
    chat = cut_reply()
    meta = chat.take_reply(ReplyTo("continue", 1), "!", {"output_tokens": 1})
    assert [t[0] for t in meta["logprobs"]] == ["Hel", "lo"]


@pytest.mark.parametrize("k, lines", [(0, ["'Hel'  p = 0.905  (logprob -0.100)", "   'Hi'  0.050"]), (1, []), (-1, [])])
def test_a_token_tip_gives_the_tokens_probability_with_its_alternatives(k, lines):
    assert token_tip([["Hel", -0.1, [["Hi", -3.0]]]], k).splitlines() == lines
