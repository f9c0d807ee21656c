"""A chat's versions without any widget: regenerated answers and edited questions, each with the
turns that followed it, switched, saved and read back; chats saved before versions still load."""

from __future__ import annotations

import json

from ui.model.history import Chat, ChatStore, Message


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
