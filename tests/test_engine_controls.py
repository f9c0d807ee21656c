"""Every backend control is on `Engine`, by backend name; backends are built through the
registry of kinds. The tiny synthetic model, two CPU backends."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from waiting import WAIT

from engine.backends.config import BackendConfig, parse_backend_specs
from engine.backends.registry import BACKEND_KINDS, backend_kind
from engine.core.errors import InvalidRequest
from engine.core.request import SamplingParams
from engine.core.snapshot import Rates
from engine.engine import Engine


@pytest.fixture(scope="module")
def eng():
    e = Engine.load("synthetic:tiny", parse_backend_specs(["cpu:threads=1,cap=2,ctx=512",
                                                          "cpu:threads=1,cap=3,ctx=512"]))
    yield e
    e.close()


def test_controls_by_name(eng):
    assert eng.backend_names == ["cpu0", "cpu1"] and eng.devices == {"cpu0": "cpu", "cpu1": "cpu"}
    eng.set_cap("cpu0", 1)
    assert eng.cap("cpu0") == 1 and eng.backend_snapshot("cpu0").cap == 1
    eng.set_rates("cpu1", Rates(11.0, 3.0, source="override"))
    assert eng.rates("cpu1") == Rates(11.0, 3.0, source="override")
    eng.warm([1, 40, 41, 42], backend="cpu1", timeout=WAIT)
    assert eng.backend_snapshot("cpu1").cache.cached_tokens == 4
    eng.set_cache_enabled("cpu1", False, timeout=WAIT)
    snap = eng.backend_snapshot("cpu1")
    assert not snap.cache.enabled and snap.cache.cached_tokens == 0
    info = eng.info("cpu0")
    assert (info.device, info.n_ctx, info.threads) == ("cpu", 512, 1)
    with pytest.raises(InvalidRequest, match="unknown backend"):
        eng.set_cap("nope", 2)


def test_a_config_no_kind_builds_is_refused():
    @dataclass(frozen=True)
    class Unbuilt:
        name: str = "x"

    with pytest.raises(InvalidRequest, match="no backend kind builds a Unbuilt"):
        Engine.load("synthetic:tiny", [Unbuilt()])


def test_a_new_kind_is_one_registered_builder():
    """A kind registers its builder for its config type; `Engine.load` then builds it."""

    @dataclass(frozen=True)
    class Twin:
        inner: BackendConfig

    @backend_kind(Twin)
    def build(c, ctx):
        return BACKEND_KINDS[BackendConfig](c.inner, ctx)

    try:
        with Engine.load("synthetic:tiny", [Twin(BackendConfig(name="t", threads=1, n_ctx=256))]) as e:
            assert e.backend_names == ["t"]
            assert e.generate([1, 40], SamplingParams(max_tokens=4)).result(WAIT).output_tokens > 0
    finally:
        BACKEND_KINDS.pop(Twin)
