"""Client libraries as their users drive them, against a live `tandem serve` on the default model
(SmolLM2-135M-Instruct): LangChain's `ChatOpenAI` (`with_structured_output` of a nested model,
by function calling and by JSON schema; `use_responses_api=True`) and instructor's TOOLS mode
with a `List[X]` response model. Both libraries are in the `test` extra. Replies are greedy and
short; every wait is bounded."""

from __future__ import annotations

import json

import instructor
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from servers import Server

# flash_attn=on: a greedy reply does not move with what shares its batch or with a cache hit
# (the README's `cpu:flash_attn=on`), so a library's retry sees the reply its first try saw.
SPEC = "cpu:threads=2,cap=4,ctx=2048,flash_attn=on"  # two threads: with one, instructor's list reply runs past max_tokens
TIMEOUT = 600  # seconds for one reply on a loaded two-core machine


class Address(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)


class Person(BaseModel):
    """A person and where they live."""

    name: str = Field(max_length=24)
    home: Address


class User(BaseModel):
    name: str = Field(max_length=16)
    age: int


def serve() -> Server:
    return Server("--model", "default", "--backend", SPEC, "--no-calibrate").wait_healthy()  # one backend: nothing to route


@pytest.fixture(scope="module")
def server():
    srv = serve()
    yield srv
    srv.close()


@pytest.fixture
def fresh_server():
    """A server of its own: its empty cache makes the greedy reply the one a first request gets."""
    srv = serve()
    yield srv
    srv.close()


def chat_model(server, **kw) -> ChatOpenAI:
    return ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="default", temperature=0,
                      max_retries=0, timeout=TIMEOUT, **kw)


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output_of_a_nested_model(server, method):
    structured = chat_model(server, max_tokens=200).with_structured_output(Person, method=method)
    person = structured.invoke("Ann lives in Oslo, Norway. Describe her.")
    assert isinstance(person, Person)
    assert isinstance(person.home, Address)


def test_langchain_with_the_responses_api(server):
    reply = chat_model(server, max_tokens=8, use_responses_api=True).invoke("Name a colour.")
    assert reply.text
    assert reply.usage_metadata["output_tokens"] > 0


def test_langchain_structured_output_over_the_responses_api(server):
    structured = chat_model(server, max_tokens=200, use_responses_api=True).with_structured_output(Person)
    assert isinstance(structured.invoke("Ann lives in Oslo, Norway. Describe her."), Person)


def test_instructor_tools_mode_with_a_list_model(fresh_server):
    client = instructor.from_openai(openai.OpenAI(base_url=fresh_server.url + "/v1", api_key="unused", timeout=TIMEOUT,
                                                  max_retries=0), mode=instructor.Mode.TOOLS)
    users, completion = client.chat.completions.create_with_completion(
        model="default", temperature=0, max_tokens=300, max_retries=1, response_model=list[User],
        messages=[{"role": "user", "content": "Users: Ann (31), Bob (42)."}])
    # The server's side: one call of instructor's list tool, its arguments whole and in its schema
    # (how many users SmolLM2-135M lists at temperature 0 is the model's, and varies by build).
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "IterableUser"
    assert isinstance(json.loads(call.function.arguments)["tasks"], list)
    assert isinstance(users, list) and all(isinstance(u, User) for u in users)
