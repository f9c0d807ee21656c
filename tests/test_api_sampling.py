"""OpenAI's sampling extras through the official `openai` client against a live `tandem serve`
on the default model (SmolLM2-135M-Instruct, one CPU backend): logprobs in both endpoints,
streamed and not; logit_bias; n choices that share their prompt; seed; penalties; vLLM's
`continue_final_message`; the limits refused with clear 400s; llama-server's /tokenize and /detokenize. Every wait is bounded
(the client's timeout, `servers.WAIT`)."""

from __future__ import annotations

import math
import threading
import uuid

import httpx2 as httpx
import openai
import pytest

from app.openai_schema import ApiRequest
from engine.core.errors import InvalidRequest
from engine.core.request import Request, SamplingParams

# flash_attn=on: llama.cpp's CPU flash-attention kernel gives each row the same sums whatever
# the batch beside it (the CPU default is off, for speed: engine/backends/config.py AUTO_FLASH_ATTN), so
# the same seed gives the same text beside other requests and a continuation its greedy reply.
SPEC = "cpu:threads=1,cap=4,ctx=2048,flash_attn=on"
TIMEOUT = 120  # seconds: the bound on any one request
ASK = [{"role": "user", "content": "Name three colours."}]



@pytest.fixture(scope="module")
def model(server):
    return server.get("/v1/models")["data"][0]["id"]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=TIMEOUT)


def token_id(server, text: str) -> int:
    tokens = post(server, "/tokenize", {"content": text}).json()["tokens"]
    assert len(tokens) == 1, f"{text!r} is {len(tokens)} tokens"
    return tokens[0]


# ---- pure: the engine's own bounds, the choices' seeds ----


@pytest.mark.parametrize("field,value", [
    ("logit_bias", tuple((i, 1.0) for i in range(301))),
    ("logit_bias", ((3, -100.5),)),
    ("logit_bias", ((-1, 1.0),)),
    ("presence_penalty", 2.01),
    ("frequency_penalty", float("nan")),
    ("logprobs", 21),
    ("logprobs", -1),
    ("prompt_logprobs", True),  # without logprobs
])
def test_sampling_params_refuse_extras_out_of_range(field, value):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**{field: value}).validate()
    assert e.value.param == field


def test_choices_draw_from_consecutive_seeds():
    base = Request((1, 2, 3), SamplingParams(seed=2**32 - 2))
    ((choices, _echo),) = ApiRequest("chat", base, "m", False, False, "messages", n=3).groups()
    assert [c.sampling.seed for c in choices] == [2**32 - 2, 2**32 - 1, 0]
    assert len({c.id for c in choices}) == 3 and {c.prompt_tokens for c in choices} == {(1, 2, 3)}


# ---- logprobs ----


def test_chat_logprobs_name_the_chosen_token_first_at_temperature_0(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert len(entry.top_logprobs) == 5


def test_chat_logprobs_spell_the_reply(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0, logprobs=True)
    content = r.choices[0].logprobs.content
    assert bytes(b for e in content for b in e.bytes).decode() == r.choices[0].message.content


def test_top_logprobs_are_a_distribution_part(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=6, temperature=0.8, seed=7,
                                       logprobs=True, top_logprobs=20)
    for entry in r.choices[0].logprobs.content:
        probs = [math.exp(t.logprob) for t in entry.top_logprobs]
        assert sum(probs) <= 1.0 + 1e-6
        assert probs == sorted(probs, reverse=True)


def test_completion_logprobs_have_openais_shape(client, model):
    r = client.completions.create(model=model, prompt="The sky is", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(logprob) == max(top.values())  # greedy: the top one
        assert len(top) <= 3


def test_streamed_chat_logprobs_come_with_their_text(client, model):
    stream = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0, logprobs=True,
                                            stream=True)
    text, spelled = "", b""
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].logprobs:
                spelled += bytes(b for e in chunk.choices[0].logprobs.content for b in e.bytes)
    assert spelled.decode() == text and text


def test_streamed_completion_logprobs_cover_every_token(client, model):
    stream = client.completions.create(model=model, prompt="The sky is", max_tokens=6, temperature=0, logprobs=1,
                                       stream=True)
    tokens, text = [], ""
    for chunk in stream:
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
    assert "".join(tokens) == text and len(tokens) == 6


# ---- logit_bias, penalties, seed ----


def test_a_large_negative_logit_bias_keeps_the_greedy_token_out(server, client, model):
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0, logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    banned = token_id(server, first)
    biased = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0, logprobs=True,
                                            logit_bias={str(banned): -100})
    assert first not in [e.token for e in biased.choices[0].logprobs.content]


def test_a_large_positive_logit_bias_forces_its_token(server, client, model):
    forced = token_id(server, " blue")
    r = client.completions.create(model=model, prompt="The sky is", max_tokens=3, temperature=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == " blue" * 3


def test_frequency_penalty_changes_a_repetitive_greedy_reply(client, model):
    prompt = "Repeat after me: hello hello hello"  # greedy says " hello" 24 times
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
    penalised = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                          frequency_penalty=2.0)
    assert penalised.choices[0].text.count("hello") < plain.choices[0].text.count("hello")


def test_the_same_seed_gives_the_same_text_at_temperature_08(client, model):
    def ask():
        return client.chat.completions.create(model=model, messages=ASK, max_tokens=16, temperature=0.8,
                                              seed=1234).choices[0].message.content

    assert ask() == ask()


def test_the_same_seed_gives_the_same_text_beside_other_requests(client, model):
    def ask():
        return client.chat.completions.create(model=model, messages=ASK, max_tokens=16, temperature=0.8,
                                              seed=99).choices[0].message.content

    alone = ask()
    other = threading.Thread(target=lambda: client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=24, temperature=0.8))
    other.start()
    beside = ask()
    other.join(TIMEOUT)
    assert beside == alone


# ---- n ----


def prompt_tokens_computed(server) -> int:
    return sum(b["prompt_tokens_computed"] for b in server.get("/v1/routing")["backends"])


def test_n_choices_compute_their_prompt_once(server, client, model):
    prompt = f"{uuid.uuid4().hex} is a code. Write a short poem about it."  # nothing of it is cached
    before = prompt_tokens_computed(server)
    r = client.completions.create(model=model, prompt=prompt, n=3, max_tokens=6, temperature=0.8, seed=5)
    computed = prompt_tokens_computed(server) - before
    assert [c.index for c in r.choices] == [0, 1, 2]
    # The prompt once (less a cached BOS, if any), then each other choice's last prompt token.
    assert r.usage.prompt_tokens - 1 <= computed - 2 <= r.usage.prompt_tokens


def test_n_choices_stream_under_their_index(client, model):
    stream = client.chat.completions.create(model=model, messages=ASK, n=2, max_tokens=6, temperature=0.8,
                                            stream=True)
    finished = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_n_choices_with_a_seed_differ_from_each_other(client, model):
    r = client.completions.create(model=model, prompt="My favourite animal is", n=3, max_tokens=12,
                                  temperature=1.0, seed=11)
    assert len({c.text for c in r.choices}) > 1


def test_n_choices_with_a_seed_repeat_across_calls(client, model):
    prompt = f"{uuid.uuid4().hex} is my favourite animal because"  # computed by the first call, cached for the second

    def ask():
        r = client.completions.create(model=model, prompt=prompt, n=3, max_tokens=12, temperature=1.0, seed=23)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    assert ask() == ask()


# ---- echo ----


def test_echo_puts_the_prompt_before_the_reply(client, model):
    r = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith("The sky is") and len(r.choices[0].text) > len("The sky is")


def test_echo_with_logprobs_lists_the_prompt_tokens_first(client, model):
    r = client.completions.create(model=model, prompt="The sky is", max_tokens=3, temperature=0, logprobs=2,
                                  echo=True)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:n_prompt]) == "The sky is"


def test_echo_with_logprobs_computes_the_cached_prompt_again(server, client, model):
    prompt = f"{uuid.uuid4().hex} and the sky"
    client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)  # now cached
    before = prompt_tokens_computed(server)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=0, echo=True)
    assert prompt_tokens_computed(server) - before == r.usage.prompt_tokens  # cached tokens have no logits
    assert len(r.choices[0].logprobs.tokens) == r.usage.prompt_tokens + 1


# ---- continue_final_message ----


def test_a_continued_assistant_message_goes_on_with_the_same_greedy_reply(client, model):
    whole = client.chat.completions.create(model=model, messages=ASK, max_tokens=24,
                                           temperature=0).choices[0].message.content
    words = whole.split(" ")
    assert len(words) > 3, whole
    head = " ".join(words[:len(words) // 2])  # cut before a space: a token boundary
    rest = client.chat.completions.create(model=model, messages=[*ASK, {"role": "assistant", "content": head}],
                                          max_tokens=24, temperature=0,
                                          extra_body={"continue_final_message": True}).choices[0].message.content
    # The reply goes on from the head, as the greedy reply did: its next word is the one that
    # followed the head. (Not every later word: on the Q4_1 model a near-tie can flip a few
    # tokens on when the head was computed as a prompt rather than generated token by token.)
    following = words[len(words) // 2]
    assert rest.lstrip().startswith(following), (head, rest, whole)


def test_continue_final_message_needs_an_assistant_message_last(server, model):
    r = post(server, "/v1/chat/completions", {"model": model, "messages": ASK, "max_tokens": 4,
                                               "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


# ---- refusals ----


REFUSED = [
    # (endpoint, body, param)
    ("/v1/chat/completions", {"messages": ASK, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": ASK, "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": ASK, "logit_bias": {"999999": -1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": ASK, "logit_bias": {"x": -1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": ASK, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, "logprobs"),
    ("/v1/chat/completions", {"messages": ASK, "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": ASK, "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": ASK, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": ASK, "n": 17}, "n"),
    ("/v1/chat/completions", {"messages": ASK, "n": 16, "max_tokens": 1000}, "n"),
    ("/v1/chat/completions", {"messages": ASK, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {"messages": ASK, "seed": 2**32}, "seed"),
]


@pytest.mark.parametrize("path,body,param", REFUSED, ids=[f"{p}:{','.join(k for k in b if k not in ('messages', 'prompt'))}"
                                                            for p, b, _ in REFUSED])  # the same in every process
def test_out_of_range_values_get_a_clear_400(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"] or param == "n"


def test_the_openai_client_sees_a_refusal_as_bad_request(client, model):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=ASK, n=17)


# ---- tokenize / detokenize ----


def test_detokenize_inverts_tokenize(server):
    text = "Hello, world! Café"
    tokens = post(server, "/tokenize", {"content": text})
    assert post(server, "/detokenize", tokens.json()).json() == {"content": text}


def test_tokenize_with_pieces_names_each_piece(server):
    pieces = post(server, "/tokenize", {"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "Hello world"
    assert all(isinstance(p["id"], int) for p in pieces)


def test_detokenize_refuses_ids_outside_the_vocabulary(server):
    r = post(server, "/detokenize", {"tokens": [1, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
