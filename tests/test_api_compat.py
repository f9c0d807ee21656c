"""The API's last client defects, through the official `openai` client and plain HTTP against a
live `tandem serve` on the default model (SmolLM2-135M-Instruct), and on a copy of it whose chat
template thinks (Qwen3's `enable_thinking` and `<think>` block): Responses logprobs, input
items, item status and `allowed_tools`; completions prompt lists; plain-word refusals of
images; paths without `/v1` and with a trailing slash (behind the key check too); a
`Retry-After` from the queue's expected wait; one model id everywhere; `chat_template_kwargs`
and `reasoning_content`, whole and streamed. Replies are greedy and short; every wait is bounded."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx2 as httpx
import openai
import pytest
from servers import Server
from test_server import LoopThread

from app.server import create_app
from engine.backends.config import parse_backend_specs
from engine.core.request import SamplingParams
from engine.core.snapshot import Rates
from engine.engine import Engine

SPEC = "cpu:threads=2,cap=4,ctx=2048,flash_attn=on"
TIMEOUT = 300
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
REMINDER = {"type": "function", "name": "set_reminder", "description": "Remind the user of something",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}
IMAGE = "data:image/png;base64,iVBORw0KGgo="


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=TIMEOUT)


# ---- Responses ----


def test_responses_logprobs_come_with_the_output_text(client):
    r = client.responses.create(model="default", input="Name a colour.", max_output_tokens=5, temperature=0,
                                include=["message.output_text.logprobs"], top_logprobs=2)
    part = r.output[0].content[0]
    assert len(part.logprobs) == r.usage.output_tokens == 5
    assert "".join(e.token for e in part.logprobs) == part.text
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in part.logprobs)


def test_streamed_responses_logprobs_come_with_each_delta(client):
    events = list(client.responses.create(model="default", input="Name a colour.", max_output_tokens=4,
                                          temperature=0, include=["message.output_text.logprobs"], stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert sum(len(e.logprobs) for e in deltas) == 4 and all(e.logprobs for e in deltas)


def test_a_streamed_responses_text_answer_with_tools_comes_token_by_token(client):
    events = list(client.responses.create(model="default", input="Is it raining in Tokyo?", tools=[WEATHER],
                                          max_output_tokens=32, temperature=0, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 5 and not "".join(deltas).lstrip().startswith("{"), deltas
    assert events[-1].response.output[0].type == "message"


def test_a_reply_cut_by_max_output_tokens_leaves_its_message_incomplete(client):
    r = client.responses.create(model="default", input="Count from one to fifty in words.", max_output_tokens=3,
                                temperature=0)
    assert r.status == "incomplete" and r.output[0].status == "incomplete"


def test_input_items_list_a_responses_own_input(client):
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    r = client.responses.create(model="default", input=items, tools=[WEATHER], max_output_tokens=4, temperature=0)
    page = client.responses.input_items.list(r.id)
    assert [i.type for i in page.data] == ["function_call_output", "function_call", "message"]  # newest first
    assert page.data[2].content[0].text == "What is the weather in Paris?" and not page.has_more
    first = client.responses.input_items.list(r.id, order="asc", limit=1)
    assert [i.type for i in first.data] == ["message"] and first.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=first.data[0].id)
    assert [i.type for i in rest.data] == ["function_call", "function_call_output"]


def test_input_items_of_an_unknown_response_are_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_allowed_tools_narrows_the_functions_a_reply_may_call(client):
    ask = {"model": "default", "input": "Remind me to buy milk.", "tools": [WEATHER, REMINDER], "temperature": 0,
           "max_output_tokens": 40}
    assert client.responses.create(**ask, tool_choice="required").output[0].name == "get_weather"  # left to itself
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "set_reminder"}]}
    r = client.responses.create(**ask, tool_choice=choice)
    assert r.output[0].type == "function_call" and r.output[0].name == "set_reminder"
    assert r.tool_choice.type == "allowed_tools" and [t.name for t in r.tools] == ["get_weather", "set_reminder"]


def test_allowed_tools_naming_an_unknown_function_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", input="Hi", tools=[WEATHER], tool_choice={
            "type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "nope"}]})
    assert e.value.body["param"] == "tool_choice"


# ---- completions, refusals, paths, ids ----


def test_completions_take_a_list_of_prompts(client):
    r = client.completions.create(model="default", prompt=["Hello", "The sky is"], max_tokens=3, n=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = client.completions.create(model="default", prompt="The sky is", max_tokens=3, temperature=0)
    assert r.choices[2].text == r.choices[3].text == alone.choices[0].text
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == alone.usage.prompt_tokens + client.completions.create(
        model="default", prompt="Hello", max_tokens=1).usage.prompt_tokens


def test_a_list_of_token_id_prompts_is_taken(server):
    r = post(server, "/v1/completions", {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 2, "temperature": 0})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1] and r.json()["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": IMAGE}}]}]}),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE}]}]}),
])
def test_an_image_is_refused_in_plain_words(server, path, body):
    r = post(server, path, body)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "this model does not take images" in message and IMAGE not in message, message


@pytest.mark.parametrize("path", ["/chat/completions", "/v1/chat/completions/", "/chat/completions/"])
def test_chat_answers_on_its_alias_paths(server, path):
    r = post(server, path, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


@pytest.mark.parametrize("path", ["/models", "/models/", "/v1/models/", "/v1/models/default/"])
def test_models_answer_on_their_alias_paths(server, path):
    assert httpx.get(server.url + path, timeout=TIMEOUT).status_code == 200


def test_the_model_id_is_the_same_everywhere(client):
    served = client.models.retrieve("default").id
    assert client.models.list().data[0].id == served
    assert client.completions.create(model="default", prompt="Hi", max_tokens=1).model == served
    assert client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=1).model == served
    assert client.responses.create(model="default", input="Hi", max_output_tokens=1).model == served
    assert client.embeddings.create(model="default", input="Hi").model == served


@pytest.fixture
def keyed():
    """A server in this process with an API key, and one slot that queues one more: (engine, base URL)."""
    loop = LoopThread()
    try:
        with Engine.load("synthetic:tiny", parse_backend_specs(["cpu:threads=1,cap=1,max_queue=1,ctx=512"])) as eng, \
                loop.serving(create_app(eng, api_key="k")) as base:
            yield eng, base
    finally:
        loop.close()


@pytest.mark.parametrize("method,path", [("POST", "/completions"), ("POST", "/v1/completions/"), ("GET", "/models"),
                                         ("GET", "/models/"), ("POST", "/embeddings"), ("GET", "/routing")])
def test_an_alias_path_needs_the_key_as_its_v1_path_does(keyed, method, path):
    _, base = keyed
    r = httpx.request(method, base + path, json={"prompt": "x", "input": "x"}, timeout=TIMEOUT)
    assert r.status_code == 401, r.text
    r = httpx.request(method, base + path, json={"prompt": [1], "input": [[1]], "max_tokens": 1},
                      headers={"Authorization": "Bearer k"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text


def test_retry_after_is_the_queues_expected_wait(keyed):
    eng, base = keyed
    (backend,) = eng.backends.values()
    # Rates the test sets, so the estimate does not depend on what an earlier test stored: the queued
    # request's 400 tokens at 100 tok/s put the wait at seconds, whatever this machine's speed.
    eng.set_rates(backend.name, Rates(prefill_tok_s=1000.0, decode_tok_s=100.0, source="override"))
    gate, held = threading.Event(), threading.Event()
    try:
        blocker = backend.call(lambda b: (held.set(), gate.wait(TIMEOUT)))  # holds the worker between steps
        assert held.wait(TIMEOUT)
        queued = eng.generate([1, 40, 41], SamplingParams(max_tokens=400, temperature=0))  # fills the one place
        r = httpx.post(base + "/v1/completions", headers={"Authorization": "Bearer k"},
                       json={"prompt": [1, 40], "max_tokens": 2}, timeout=TIMEOUT)
        decision = eng.router.recent()[-1]
    finally:
        gate.set()
    blocker.result(TIMEOUT)
    queued.cancel()
    assert r.status_code == 429
    wait = decision.chosen.queue_wait_s
    assert wait > 1.5, decision.chosen
    assert int(r.headers["Retry-After"]) == min(-(-wait // 1), 60)


# ---- thinking models ----

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
# The model's reply, fixed by a grammar: the reasoning, the block's end, the answer.
THOUGHT = 'root ::= "The capital is Paris." "</think>" "\\n\\n" "Paris."'


@pytest.fixture(scope="module")
def thinker(default_path, tmp_path_factory):
    """`tandem serve` on a copy of the default model whose template thinks (Qwen3's shape)."""
    path = tmp_path_factory.mktemp("thinker") / "thinker.gguf"
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--force", "--chat-template",
                    THINKING_TEMPLATE, str(default_path), str(path)], check=True, capture_output=True, timeout=TIMEOUT)
    srv = Server("--model", str(path), "--backend", SPEC, "--no-calibrate").wait_healthy()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
    srv.close()


ASK = [{"role": "user", "content": "What is the capital of France?"}]


def test_a_thinking_block_is_split_into_reasoning_content(thinker):
    r = thinker.chat.completions.create(model="thinker", messages=ASK, temperature=0, extra_body={"grammar": THOUGHT})
    message = r.choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == ("Paris.", "The capital is Paris.")


def test_a_streamed_thinking_block_arrives_as_reasoning_deltas(thinker):
    stream = thinker.chat.completions.create(model="thinker", messages=ASK, temperature=0, stream=True,
                                             extra_body={"grammar": THOUGHT})
    deltas = [c.choices[0].delta for c in stream if c.choices]
    reasoning = [d.model_extra.get("reasoning_content") for d in deltas if d.model_extra.get("reasoning_content")]
    content = [d.content for d in deltas if d.content]
    assert len(reasoning) >= 2 and "".join(reasoning) == "The capital is Paris."
    assert "".join(content) == "Paris." and "<think>" not in "".join(content)


def test_chat_template_kwargs_reach_the_template(thinker):
    def prompt_tokens(**kwargs) -> int:
        return thinker.chat.completions.create(model="thinker", messages=ASK, max_tokens=1, extra_body=kwargs
                                               ).usage.prompt_tokens

    thinking, plain = prompt_tokens(), prompt_tokens(chat_template_kwargs={"enable_thinking": False})
    assert plain > thinking  # `<think>\n\n</think>\n\n` closes the block in the prompt
    r = thinker.chat.completions.create(model="thinker", messages=ASK, temperature=0, max_tokens=3,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content and not r.choices[0].message.model_extra.get("reasoning_content")


def test_chat_template_kwargs_cannot_set_the_templates_own_globals(thinker):
    with pytest.raises(openai.BadRequestError) as e:
        thinker.chat.completions.create(model="thinker", messages=ASK, max_tokens=1,
                                        extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert e.value.body["param"] == "chat_template_kwargs"


def test_a_model_without_thinking_keeps_think_text_as_content(client):
    r = client.chat.completions.create(model="default", messages=ASK, temperature=0,
                                       extra_body={"grammar": 'root ::= "<think>a</think>b"'})
    assert r.choices[0].message.content == "<think>a</think>b"
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
