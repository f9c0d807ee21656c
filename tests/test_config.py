"""Backend specs: the cap (adaptive, a ceiling, or fixed) and the KV layout keys."""

from __future__ import annotations

import pytest

from engine.backends.config import parse_backend_spec, parse_backend_specs
from engine.core.errors import InvalidRequest


@pytest.mark.parametrize("spec, cap, adaptive", [
    ("gpu", 32, True),  # no cap: adaptive up to the device's ceiling
    ("gpu:cap=auto", 32, True),
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


def test_contexts_take_the_spec_name():
    assert [c.name for c in parse_backend_specs(["gpu:name=big,contexts=3"])] == ["big-a", "big-b", "big-c"]


@pytest.mark.parametrize("n", [0, 27])
def test_a_context_count_out_of_range_is_refused(n):
    with pytest.raises(InvalidRequest, match="contexts must be 1 to 26"):
        parse_backend_specs([f"gpu:contexts={n}"])


def test_contexts_without_a_cap_share_the_device_ceiling():
    assert [c.resolved().cap for c in parse_backend_specs(["gpu:contexts=2"])] == [16, 16]


@pytest.mark.parametrize(("spec", "device", "flash"), [
    ("cpu", "cpu", "off"),  # the CPU's flash-attention kernel is slow for decode rows (engine/backends/local.py)
    ("gpu", "gpu", "auto"),  # llama.cpp's choice
    ("cpu:flash_attn=on", "cpu", "on"),  # a spec that says keeps it
    ("gpu:flash_attn=off", "gpu", "off"),
])
def test_flash_attention_left_to_auto_follows_the_device(spec, device, flash):
    assert parse_backend_spec(spec).resolved(device).flash_attn == flash
