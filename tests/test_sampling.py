"""Device sampling: the fused greedy argmax and the guarded `ignore_eos` chain choose exactly
the tokens llama.cpp's own greedy and logit-bias chain choose."""

from __future__ import annotations

import ctypes
import dataclasses
import re

import pytest

from engine.core.errors import InvalidRequest
from engine.core.request import Request, RequestStatus, SamplingParams
from engine.llama import grammar, greedy, holding_gil, runner, sampling

WAIT = 120


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def test_the_tensor_mirror_reads_ggml_views():
    """`row_of` finds the matrix and row behind a row view, read through our mirror of
    `struct ggml_tensor` from tensors the real library made."""
    P = ctypes.c_void_p
    ggml_init = holding_gil("ggml_init", [_InitParams], P)
    ggml_free = holding_gil("ggml_free", [P], None)
    new_2d = holding_gil("ggml_new_tensor_2d", [P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], P)
    new_1d = holding_gil("ggml_new_tensor_1d", [P, ctypes.c_int, ctypes.c_int64], P)
    ctx = ggml_init(_InitParams(1 << 20, None, True))
    try:
        m = new_2d(ctx, 0, 1000, 7)
        row = greedy.ggml_view_1d(ctx, m, 1000, 5 * 1000 * 4)
        assert greedy.row_of(row) == (m, 5)  # a native-boundary helper: its contract is internal
        assert greedy.row_of(m) is None  # not a view
        assert greedy.row_of(greedy.ggml_view_1d(ctx, m, 999, 4000)) is None  # not a whole row
        assert greedy.row_of(new_1d(ctx, 0, 1000)) is None
    finally:
        ggml_free(ctx)


def _texts(b, model, prompts, sp, together=True):
    if together:
        handles = [b.enqueue(Request(tuple(p), sp)) for p in prompts]
        return [h.result(WAIT) for h in handles]
    return [b.enqueue(Request(tuple(p), sp)).result(WAIT) for p in prompts]


def test_fused_greedy_chooses_what_llama_greedy_chooses(make_backend, tiny_model):
    """Four sequences decoding together take their rows of one argmax; the tokens are those
    of llama.cpp's per-sequence greedy (bit-exact on the F16 tiny model)."""
    prompts = [[5 + i, 9, 3 * i + 1, 40 + i] for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=20)
    fused = make_backend(tiny_model, cap=4, cache=False)
    before = greedy.BUILDS.copy()
    out = _texts(fused, tiny_model, prompts, sp)
    built = greedy.BUILDS - before
    plain = _texts(make_backend(tiny_model, cap=4, cache=False, fused_greedy=False), tiny_model, prompts, sp)
    assert [r.text for r in out] == [r.text for r in plain]
    assert all(r.output_tokens == 20 for r in out)
    # Each graph build made one argmax and the four chains took their rows of it.
    assert built["shared"] >= 1 and built["row"] == 4 * built["shared"], built


def test_ignore_eos_guard_takes_back_end_tokens(make_backend, default_model):
    """A chat model wants to stop; with `ignore_eos` the guarding chain's end token is taken
    back and picked again with end tokens banned: the text is that of the biased chain."""
    prompts = [default_model.tokenize(f"<|im_start|>user\nSay {w}.<|im_end|>\n<|im_start|>assistant\n",
                                      add_special=False) for w in ("hi", "yes")]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    guarded = make_backend(default_model, cap=2, cache=False)
    out = _texts(guarded, default_model, prompts, sp, together=False)
    biased = _texts(make_backend(default_model, cap=2, cache=False, fused_greedy=False), default_model,
                    prompts, sp, together=False)
    assert [r.text for r in out] == [r.text for r in biased]
    assert all(r.output_tokens == 24 and r.finish_reason == "length" for r in out)
    assert guarded.stats().eog_redos >= 1, "the prompts were chosen for a model that wants to end early"
    # Together, too: every request runs to its length and no end token leaks into the text.
    again = _texts(guarded, default_model, prompts * 2, sp)
    assert all(r.output_tokens == 24 and "<|im_end|>" not in r.text for r in again)


def test_host_sampling_keeps_llama_chains(make_backend, tiny_model):
    """Without device sampling nothing is fused or guarded (the logit bias is cheap on the host)."""
    b = make_backend(tiny_model, cap=2, cache=False, backend_sampling=False)
    before = greedy.BUILDS.copy()
    r = b.enqueue(Request((5, 6, 7), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))).result(WAIT)
    assert r.output_tokens == 8 and before == greedy.BUILDS and b.stats().eog_redos == 0


def test_cached_sequences_leave_the_chained_ids_to_new_requests(make_backend, tiny_model):
    """Finished sequences the prefix cache keeps move to high ids, so each new request lands
    on an id whose chain is still attached: one attach per id for the whole run, not one per
    request (each attach is a graph reserve, which stalls every running sequence on a GPU)."""
    b = make_backend(tiny_model, cap=4, n_ctx=8192)
    prefix = [(7 * i) % 200 + 5 for i in range(200)]
    b.warm(prefix).result(WAIT)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    handles = [b.enqueue(Request(tuple(prefix + [210 + i, 240 + i]), sp)) for i in range(24)]
    assert all(h.result(WAIT).output_tokens == 16 for h in handles)
    assert b.cache.n_holders == 24, "every reply is cached, each on its own holder id"
    assert b.stats().sampler_attaches == 4 and b.stats().samplers_attached == 4
    assert b.kv_cells_used() == 200 + 24 * (2 + 15), "the prefix once, each request's own cells once"
    # More than the ids left for the cache (32 - 4): the oldest cached replies make way.
    handles = [b.enqueue(Request(tuple(prefix + [1 + i, 240 + i]), sp)) for i in range(16)]
    assert all(h.result(WAIT).output_tokens == 16 for h in handles)
    assert b.cache.n_holders == 32 - 4 and b.stats().sampler_attaches == 4 and b.stats().samplers_attached == 4


def test_the_token_read_after_sync_is_the_public_functions(make_backend, tiny_model):
    """The backend reads sampled tokens through llama_context's own method (no stream sync per
    read); after a step's sync it returns what llama_get_sampled_token_ith returns."""
    from engine import llama

    assert llama.sampled_token_after_sync is not llama.get_sampled_token_ith, "libllama exports the method"
    b = make_backend(tiny_model, cap=4, cache=False)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for h in [b.enqueue(Request((5 + i, 9, 13), sp)) for i in range(4)]:
        h.result(WAIT)

    # An ABI fact about the backend's own llama context, which nothing outside the worker holds:
    # read through the private runner, on the worker thread.
    def read(bk):  # the last step decoded the four sequences' 8th tokens: rows 0..3
        return [(llama.get_sampled_token_ith(bk._runner.ctx, i), llama.sampled_token_after_sync(bk._runner.ctx, i))
                for i in range(4)]

    pairs = b.call(read).result(WAIT)
    assert all(a == c and 0 <= a < tiny_model.n_vocab for a, c in pairs), pairs


def test_text_made_while_the_next_step_runs_is_the_same_text(make_backend, tiny_model):
    """`overlap_text` (on by default for GPU backends) turns a step's tokens into text after
    the next step is launched; requests end the same way and stream the same text (the F16
    tiny model: bit-exact whatever the batch shapes)."""
    probe = make_backend(tiny_model, cap=1, cache=False)
    full = probe.enqueue(Request((5, 6, 7), SamplingParams(temperature=0, max_tokens=30))).result(WAIT).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert len(stop) == 3
    jobs = [
        ((5, 6, 7), SamplingParams(temperature=0, max_tokens=12)),
        ((5, 6, 7), SamplingParams(temperature=0, max_tokens=30, stop=(stop,))),  # ends on a stop string
        ((9, 8, 7, 6), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
        ((11, 12), SamplingParams(temperature=0, max_tokens=30)),
    ]
    runs = {}
    for overlap in (False, True):
        b = make_backend(tiny_model, cap=4, cache=False, overlap_text=overlap)
        handles = [b.enqueue(Request(prompt, sp)) for prompt, sp in jobs]
        streamed = ["".join(h) for h in handles]
        records = [h.result(WAIT) for h in handles]
        assert streamed == [r.text for r in records]
        runs[overlap] = [(r.text, r.finish_reason, r.output_tokens) for r in records]
    assert runs[True] == runs[False]
    assert [r[1] for r in runs[True]] == ["length", "stop", "length", "length"]
    assert runs[True][1][0] == full[:full.index(stop)]


@pytest.mark.parametrize("how", ["cancel", "crash"])
def test_pending_text_is_not_lost_when_a_request_ends_early(make_backend, tiny_model, how):
    """With `overlap_text`, a request that is cancelled, or whose backend fails, still gets
    every token's text it was counted for: what streamed is what its record says."""
    from waiting import wait_until

    b = make_backend(tiny_model, cap=2, cache=False, overlap_text=True)
    sp = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
    h = b.enqueue(Request((5, 6, 7), sp))
    wait_until(lambda: any(i.generated > 20 for i in b.snapshot().items), what="decoding", unless=lambda: h.done)
    if how == "cancel":
        h.cancel()
    else:
        b.inject_fault("crash")
    streamed = "".join(h)
    record = h.result(WAIT)
    assert record.status in (RequestStatus.FINISHED_CANCELLED, RequestStatus.FINISHED_ERROR)
    assert streamed == record.text and 20 < record.output_tokens < 3000


# ---- OpenAI's extras: per-sequence fallbacks beside fused greedy ----


def test_a_logprobs_request_samples_the_greedy_tokens_on_the_host(make_backend, tiny_model):
    """Beside three fused greedy requests, one that asks for logprobs samples on the host (its
    chain is not attached) and chooses the same tokens; its logprobs name them first."""
    prompts = [[5 + i, 9, 3 * i + 1, 40 + i] for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=12)
    b = make_backend(tiny_model, cap=4, cache=False, idle_sampler_s=600)  # idle chains stay for the count
    plain = _texts(b, tiny_model, prompts, sp)
    handles = [b.enqueue(Request(tuple(p), sp)) for p in prompts[:3]]
    asked = b.enqueue(Request(tuple(prompts[3]), SamplingParams(temperature=0, max_tokens=12, logprobs=3)))
    mixed = [h.result(WAIT) for h in [*handles, asked]]
    assert [r.text for r in mixed] == [r.text for r in plain]
    lps = mixed[3].logprobs
    assert len(lps) == 12 and all(e.top[0][0] == e.token and e.logprob <= 0 for e in lps)
    assert b.stats().samplers_attached == 3, "the logprobs request's id has no device chain"


def test_a_logit_bias_chain_stays_on_the_device(make_backend, tiny_model):
    """A banned token never comes, and the biased greedy chain is attached (llama.cpp runs the
    logit-bias and greedy samplers in the graph)."""
    b = make_backend(tiny_model, cap=1, cache=False, idle_sampler_s=600)
    prompt = (5, 9, 1, 40)
    first = b.enqueue(Request(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=0))).result(WAIT)
    banned = first.logprobs[0].token
    sp = SamplingParams(temperature=0, max_tokens=12, logit_bias=((banned, -100.0),), logprobs=None)
    h = b.enqueue(Request(prompt, sp))
    r = h.result(WAIT)
    assert r.output_tokens == 12 and b.stats().samplers_attached == 1
    # The same bias on the host (a logprobs chain): the same tokens, none of them the banned one.
    check = b.enqueue(Request(prompt, dataclasses.replace(sp, logprobs=0))).result(WAIT)
    assert banned not in [e.token for e in check.logprobs] and check.text == r.text


def test_a_grammar_sequence_samples_on_the_host_beside_device_greedy_ones(make_backend, tiny_model):
    """A grammar-constrained sequence (host sampling) runs in the same steps as device greedy
    ones: its reply is in the grammar and ends with it; theirs are the tokens they choose alone."""
    prompts = [[5 + i, 9, 3 * i + 1, 40 + i] for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=20)
    b = make_backend(tiny_model, cap=4, cache=False)
    alone = _texts(b, tiny_model, prompts[:3], sp)
    constrained = SamplingParams(temperature=0, max_tokens=64, grammar='root ::= "{" [a-z]{1,5} "}"')
    handles = [b.enqueue(Request(tuple(p), sp)) for p in prompts[:3]]
    handles.append(b.enqueue(Request(tuple(prompts[3]), constrained)))
    together = [h.result(WAIT) for h in handles]
    assert [r.text for r in together[:3]] == [r.text for r in alone]
    assert re.fullmatch(r"\{[a-z]{1,5}\}", together[3].text), together[3].text
    assert together[3].finish_reason == "stop"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_grammar_no_token_can_continue_fails_only_its_request(make_backend, tiny_model, temperature):
    """A grammar that asks for a character no token spells (NUL) ends its request with an
    error (llama.cpp would abort the process); the backend keeps serving."""
    b = make_backend(tiny_model, cap=2, cache=False)
    dead = b.enqueue(Request((5, 9, 11), SamplingParams(temperature=temperature, max_tokens=8,
                                                         grammar='root ::= "a" [\\x00]'))).result(WAIT)
    assert dead.status == RequestStatus.FINISHED_ERROR
    assert "grammar allows no token" in dead.error
    after = b.enqueue(Request((5, 9, 11), SamplingParams(temperature=0, max_tokens=4))).result(WAIT)
    assert after.output_tokens == 4


# Lets every token but NUL through (as a JSON string's content lets almost all), never ends.
OPEN_GRAMMAR = 'root ::= [^\\x00] root'
# Lets few through: a refused argmax is the rule, and a search goes past its first stage.
NARROW_GRAMMAR = 'root ::= ("zq" | "xv" | "wk" | [0-9]) root'


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_grammar_reply_is_the_same_when_its_searches_stop_at_every_chunk(make_backend, tiny_model, monkeypatch,
                                                                          temperature):
    """With no share of the step to spend, a grammar search checks one chunk a step and goes on
    at the next (its input decoded again): the reply is the one whole searches give."""
    sp = SamplingParams(temperature=temperature, seed=7, max_tokens=12, grammar=NARROW_GRAMMAR)
    b = make_backend(tiny_model, cap=2, cache=False)
    monkeypatch.setattr(runner, "GRAMMAR_FLOOR_S", 3600.0)  # a whole search every step
    whole = b.enqueue(Request((5, 9, 11), sp)).result(WAIT)
    assert b.stats().grammar_deferrals == 0
    monkeypatch.setattr(runner, "GRAMMAR_SHARE", 0.0)
    monkeypatch.setattr(runner, "GRAMMAR_ALONE_SHARE", 0.0)
    monkeypatch.setattr(runner, "GRAMMAR_FLOOR_S", 0.0)
    split = b.enqueue(Request((5, 9, 11), sp)).result(WAIT)
    assert b.stats().grammar_deferrals > 0
    assert split.output_tokens == whole.output_tokens == 12
    assert split.text == whole.text


def test_a_sequence_whose_search_goes_on_is_not_decoded_again(make_backend, tiny_model, monkeypatch):
    """A search past its share goes on over the logits it copied, and its sequence takes no
    batch row meanwhile: each token costs one decode, however many steps its search took."""
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=12, grammar=NARROW_GRAMMAR)
    b = make_backend(tiny_model, cap=2, cache=False)
    for name in ("GRAMMAR_SHARE", "GRAMMAR_ALONE_SHARE", "GRAMMAR_FLOOR_S"):
        monkeypatch.setattr(runner, name, 0.0)  # one chunk of a search per step beside a decode
    record = b.enqueue(Request((5, 9, 11), sp)).result(WAIT)
    assert b.stats().grammar_deferrals > 0 and record.output_tokens == 12
    assert sum(n_decode for n_decode, _, _ in b.step_log) == record.output_tokens - 1  # the first: the prompt's row


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_grammar_search_that_stops_early_takes_the_token_a_full_pass_takes(make_backend, tiny_model, temperature):
    """Greedy stops at the first allowed token by rank, top-k at k allowed ones; a chain with a
    (zero) logit bias checks every token. The tokens are the same."""
    sp = SamplingParams(temperature=temperature, seed=3, top_k=40, max_tokens=16, grammar=OPEN_GRAMMAR)
    b = make_backend(tiny_model, cap=1, cache=False)
    early = b.enqueue(Request((5, 9, 11), sp)).result(WAIT)
    checked = b.stats().grammar_checks
    full = b.enqueue(Request((5, 9, 11), dataclasses.replace(sp, logit_bias=((7, 0.0),)))).result(WAIT)
    assert b.stats().grammar_checks - checked >= 16 * tiny_model.n_vocab  # every token, every step
    assert early.output_tokens == full.output_tokens == 16
    assert early.text == full.text


def test_a_sampled_grammar_token_inside_an_open_grammar_checks_one_stage(make_backend, tiny_model):
    """Where the grammar lets most tokens through (a JSON string's content), a temperature
    chain's search ends with its first stage: 64 candidates a token, not the vocabulary."""
    sp = SamplingParams(temperature=1.0, seed=5, top_k=40, max_tokens=16, grammar=OPEN_GRAMMAR)
    b = make_backend(tiny_model, cap=1, cache=False)
    r = b.enqueue(Request((5, 9, 11), sp)).result(WAIT)
    assert r.output_tokens == 16
    assert 0 < b.stats().grammar_checks <= 16 * sampling.STAGES[0] < 16 * tiny_model.n_vocab


def test_a_grammar_check_stops_at_its_cpu_budget(default_model, monkeypatch):
    """A grammar's check over the vocabulary (the pass a reply may pay at every token) is
    refused as soon as it has spent `MAX_PASS_MS` of CPU, before it has gone through the
    vocabulary: a costly grammar costs its sender's check no more than the budget."""
    monkeypatch.setattr(grammar, "MAX_PASS_MS", 0.001)
    # 256 alternatives sharing a long prefix: every "e" token matches every stack deeply
    text = "root ::= (" + " | ".join(f'"{"e" * 20}{i:03d}"' for i in range(256)) + ") root"
    with pytest.raises(InvalidRequest, match="MAX_PASS_MS") as refused:
        default_model.check_grammar(text)
    done = int(re.search(r"by (\d+)% of it", refused.value.message).group(1))
    assert done < 100  # stopped inside the pass


def test_a_reused_logprobs_chain_gives_this_requests_number_of_alternatives(make_backend, tiny_model):
    """An idle logprobs chain is reused by the next logprobs request on its id (same key): the
    number of alternatives is the new request's, not the one the chain was made for."""
    b = make_backend(tiny_model, cap=1, cache=False, idle_sampler_s=600)
    prompt = (5, 9, 1, 40)
    b.enqueue(Request(prompt, SamplingParams(temperature=0, max_tokens=2, logprobs=0))).result(WAIT)
    r = b.enqueue(Request(prompt, SamplingParams(temperature=0, max_tokens=2, logprobs=3))).result(WAIT)
    assert [len(e.top) for e in r.logprobs] == [3, 3]
