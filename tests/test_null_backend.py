"""The null backend kind: an engine of null backends loads no model and answers at once."""

from __future__ import annotations

import pytest
from waiting import WAIT

from engine.backends.config import parse_backend_specs
from engine.core.errors import InvalidRequest
from engine.core.events import RequestFinished
from engine.core.request import RequestStatus, SamplingParams
from engine.engine import Engine


def test_an_engine_of_null_backends_answers_every_request_at_once():
    with Engine.load(None, parse_backend_specs(["null:reply=hello", "null:reply=hello"]), policy="round-robin") as eng:
        finished = []
        eng.bus.subscribe(lambda e: finished.append(e.record.backend), (RequestFinished,))
        handles = [eng.generate("hi there", SamplingParams(max_tokens=8)) for _ in range(4)]
        records = [h.result(WAIT) for h in handles]
        assert [r.text for r in records] == ["hello"] * 4
        assert {r.status for r in records} == {RequestStatus.FINISHED_STOPPED}
        assert sorted(finished) == ["null0", "null0", "null1", "null1"], "routed like any backend"
        assert eng.model is None, "no model is loaded for null backends"
        chat = eng.chat([{"role": "user", "content": "hi"}]).result(WAIT)
        assert chat.text == "hello"
        assert eng.info("null0").device == "null"


def test_a_null_spec_with_an_unknown_key_gets_a_clear_error():
    with pytest.raises(InvalidRequest, match=r"null\[:name=N,cap=N,reply=TEXT\]"):
        parse_backend_specs(["null:speed=9"])
