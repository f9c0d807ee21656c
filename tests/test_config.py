"""Backend specs: the cap (adaptive, a ceiling, or fixed) and the KV layout keys."""

from __future__ import annotations

import pytest

from engine.backends import config as backend_module
from engine.backends.config import (
    AUTO_CAP,
    AUTO_IDLE_CELLS,
    AUTO_START,
    auto_contexts,
    auto_limits,
    auto_pool_cells,
    parse_backend_spec,
    parse_backend_specs,
    resolve_contexts,
)
from engine.core.errors import InvalidRequest


@pytest.mark.parametrize("spec, cap, adaptive", [
    ("gpu", 64, True),  # no cap: adaptive up to the device's ceiling
    ("gpu:cap=auto", 64, True),
    ("cpu:cap=auto", 16, True),
    ("gpu:cap=16", 16, True),  # an explicit cap is the ceiling
    ("gpu:cap=16,adaptive=0", 16, False),  # ... or fixed
    ("cpu:adaptive=0", 4, False),
])
def test_cap_specs(spec, cap, adaptive):
    c = parse_backend_spec(spec).resolved()
    assert (c.cap, c.adaptive) == (cap, adaptive)


def test_split_kv_sizes_each_stream():
    c = parse_backend_spec("gpu:kv=split,seq_ctx=2048,n_seq_max=40").resolved()
    assert (c.kv_unified, c.n_ctx) == (False, 81920)


def test_an_unknown_kv_layout_is_refused():
    with pytest.raises(InvalidRequest, match="kv must be unified or split"):
        parse_backend_spec("gpu:kv=paged")


def test_contexts_make_one_backend_each_with_the_spec_settings():
    configs = parse_backend_specs(["gpu:contexts=2,cap=16", "cpu"])
    assert [(c.name, c.cap, c.device) for c in configs] == [("gpu-a", 16, "gpu"), ("gpu-b", 16, "gpu"), ("cpu", 0, "cpu")]
    assert [c.group for c in configs] == ["gpu", "gpu", ""]  # the default policy picks their device first


def test_contexts_take_the_spec_name():
    assert [c.name for c in parse_backend_specs(["gpu:name=big,contexts=3"])] == ["big-a", "big-b", "big-c"]


@pytest.mark.parametrize("n", [0, 27])
def test_a_context_count_out_of_range_is_refused(n):
    with pytest.raises(InvalidRequest, match="contexts must be 1 to 26"):
        parse_backend_specs([f"gpu:contexts={n}"])


def test_contexts_without_a_cap_each_get_the_device_ceiling():
    # as two processes would: a ceiling each, not one shared (issue 26)
    assert [c.resolved().cap for c in parse_backend_specs(["gpu:contexts=2"])] == [64, 64]
    assert [c.resolved().cap for c in parse_backend_specs(["cpu:contexts=2"])] == [16, 16]


def test_contexts_are_auto_unless_the_spec_names_a_count():
    assert parse_backend_spec("gpu").contexts == 0
    assert parse_backend_spec("gpu:contexts=auto").contexts == 0
    assert parse_backend_spec("gpu:contexts=3").contexts == 3
    assert [c.name for c in parse_backend_specs(["gpu", "cpu"])] == ["gpu", "cpu"]


@pytest.mark.parametrize(("model", "free", "want", "expected"), [
    (500 << 20, 100 << 30, 1, 1),  # one wanted: one
    (500 << 20, 100 << 30, 2, 2),  # a small model, room to spare: as many as wanted
    (500 << 20, 0, 2, 2),  # free memory unknown: as wanted
    (8 << 30, 100 << 30, 2, 1),  # a large model: one (each context reads every weight per step)
    (500 << 20, (500 << 20) + (1 << 30), 3, 1),  # beside the model, no room for a second context
    (500 << 20, (500 << 20) + (5 << 30), 4, 3),  # room for two more
])
def test_auto_contexts_fit_the_model_beside_the_free_memory(model, free, want, expected):
    assert auto_contexts(model, free, want=want, max_model_bytes=4 << 30, context_bytes=2 << 30) == expected


@pytest.mark.parametrize(("model", "expected"), [
    (530 << 20, 8),  # Qwen2.5-0.5B q8_0, as measured (docs/results/gpu/contexts1)
    (2 << 30, 4),  # up to 4 GiB: four
    (8 << 30, 1),  # larger: one
])
def test_auto_contexts_follow_the_models_size(model, expected):
    assert auto_contexts(model, 0) == expected
    assert auto_contexts(model, model + (3 << 30), context_bytes=1 << 30) == min(expected, 4)  # memory still bounds it


@pytest.fixture
def two_contexts_wanted(monkeypatch):
    monkeypatch.setattr(backend_module, "AUTO_CONTEXTS", ((1 << 40, 2),))


def test_an_auto_gpu_spec_becomes_the_contexts_its_device_gets(two_contexts_wanted):
    configs = resolve_contexts(parse_backend_specs(["gpu:cap=16", "cpu"]), 500 << 20, lambda device: 100 << 30)
    assert [(c.name, c.cap, c.contexts) for c in configs] == [("gpu-a", 16, 2), ("gpu-b", 16, 2), ("cpu", 0, 1)]
    assert [c.group for c in configs] == ["gpu", "gpu", ""]


def test_a_gpu_the_user_laid_out_keeps_its_specs(two_contexts_wanted):
    configs = resolve_contexts(parse_backend_specs(["gpu:name=x", "gpu:name=y", "gpu:device=1,contexts=3"]),
                               500 << 20, lambda device: 100 << 30)
    assert [c.name for c in configs] == ["x", "y", "gpu1-a", "gpu1-b", "gpu1-c"]


def test_an_auto_spec_asks_the_free_memory_of_its_own_gpu(two_contexts_wanted):
    asked = []
    resolve_contexts(parse_backend_specs(["gpu:device=1"]), 1 << 20, lambda device: asked.append(device) or 0)
    assert asked == ["gpu1"]


@pytest.mark.parametrize(("kind", "fits", "contexts", "ceiling", "expected"), [
    ("gpu", 0, 1, 65536, 65536),  # free memory unknown: the default pool
    ("cpu", 0, 1, 16384, 4096),
    ("gpu", 1 << 20, 1, 65536, 65536),  # more room than the ceiling
    ("gpu", 1 << 20, 1, 1 << 19, 1 << 19),  # a raised ceiling: the memory's share
    ("gpu", 40000, 1, 65536, 39936),  # less room: what fits, in multiples of 256
    ("gpu", 200000, 2, 1 << 20, 99840),  # two contexts share the share
    ("gpu", 1000, 1, 65536, 4096),  # never under the CPU's default pool
    ("cpu", 1 << 20, 1, 16384, 16384),
])
def test_a_pool_without_ctx_is_sized_from_free_memory(kind, fits, contexts, ceiling, expected):
    assert auto_pool_cells(kind, fits, contexts, ceiling=ceiling) == expected


def test_the_idle_cache_budget_no_longer_follows_the_pool():
    assert parse_backend_spec("gpu").resolved().idle_cache_cells == AUTO_IDLE_CELLS["gpu"]
    assert parse_backend_spec("cpu").resolved().idle_cache_cells == AUTO_IDLE_CELLS["cpu"]
    assert parse_backend_spec("gpu:ctx=8192").resolved().idle_cache_cells == -1  # n_ctx, as before
    assert parse_backend_spec("gpu:idle_cache_cells=2048").resolved().idle_cache_cells == 2048


def test_the_device_ceiling_is_the_same_for_any_context_count():
    assert auto_limits("gpu") == (AUTO_CAP["gpu"], AUTO_START["gpu"])


@pytest.mark.parametrize(("spec", "device", "flash"), [
    ("cpu", "cpu", "off"),  # the CPU's flash-attention kernel is slow for decode rows (engine/backends/local.py)
    ("gpu", "gpu", "auto"),  # llama.cpp's choice
    ("cpu:flash_attn=on", "cpu", "on"),  # a spec that says keeps it
    ("gpu:flash_attn=off", "gpu", "off"),
])
def test_flash_attention_left_to_auto_follows_the_device(spec, device, flash):
    assert parse_backend_spec(spec).resolved(device).flash_attn == flash


def test_an_engine_resolves_auto_contexts_when_its_model_loads(tiny_path):
    from engine.engine import Engine

    eng = Engine.load(tiny_path, parse_backend_specs(["cpu:threads=1,cap=2,ctx=512"]), calibrate=False)
    try:
        assert [(b.name, b.config.contexts) for b in eng.backends.values()] == [("cpu", 1)]
    finally:
        eng.close()
