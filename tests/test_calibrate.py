"""Calibration (`engine.rates`, `tandem calibrate`): the pure parts table-driven, the
measuring on the real tiny model with two CPU backends, the store as the engine reads it."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from app.cli import main
from engine.backends.config import BackendConfig, parse_backend_specs
from engine.backends.registry import DEFAULT_RATES
from engine.core.errors import InvalidRequest
from engine.core.request import Request, SamplingParams
from engine.core.snapshot import Rates
from engine.engine import Engine
from engine.rates.fit import fit_step_model, step_table
from engine.rates.measure import calibrate_backend
from engine.rates.refresh import OnlineRefresh
from engine.rates.store import (
    ModelRates,
    RateStore,
    cache_dir,
    config_key,
    file_fingerprint,
    parse_rates,
    save_calibration,
)

SPECS = ["cpu:threads=1,cap=3,ctx=512", "cpu:threads=1,cap=3,ctx=512"]
SMALL = dict(prompt_tokens=64, gen_tokens=8, repeats=1)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch, tiny_path):
    """Each test gets an empty calibration store (the tiny model is resolved before)."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def make_engine(tiny_path):
    made = []

    def make(specs=SPECS, **kw):
        eng = Engine.load(str(tiny_path), parse_backend_specs(specs), **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


# ---- pure ----


class TestKeysAndStore:
    def test_cache_dir_honours_the_environment(self, own_cache):
        assert cache_dir() == own_cache
        assert RateStore().path == own_cache / "rates.json"

    def test_config_key_keeps_what_changes_speed_only(self):
        a = BackendConfig(name="cpu0", device="cpu", threads=2, cap=4)
        assert config_key(a) == config_key(BackendConfig(name="other", device="cpu", threads=2, cap=64, n_ctx=99))
        assert config_key(a) != config_key(BackendConfig(device="cpu", threads=3))
        assert config_key(a) != config_key(BackendConfig(device="cpu", threads=2, n_batch=256))
        assert config_key(a) != config_key(BackendConfig(device="cpu", threads=2, backend_sampling=False))
        assert config_key(a) == config_key(BackendConfig(device="cpu", threads=2, n_seq_max=100))
        assert config_key(BackendConfig(device="auto", threads=2), "gpu").startswith("gpu:")

    def test_each_gpu_has_its_own_key(self):
        # gpu:device=N loads the model as device "gpu"; the key keeps which GPU it is
        keys = {config_key(c, "gpu") for c in parse_backend_specs(["gpu:device=0", "gpu:device=1", "gpu"])}
        assert {k.partition(":")[0] for k in keys} == {"gpu0", "gpu1", "gpu"}

    def test_a_gpus_stored_rates_price_that_gpu_only(self, tiny_path):
        gpu0, gpu1 = parse_backend_specs(["gpu:device=0", "gpu:device=1"])
        RateStore().save(file_fingerprint(tiny_path), config_key(gpu1, "gpu"),
                         {"rates": {"prefill_tok_s": 9000.0, "decode_tok_s": 900.0}})
        stored = ModelRates(tiny_path)
        assert stored.get(gpu1, "gpu").prefill_tok_s == 9000.0
        assert stored.get(gpu0, "gpu") is None

    @staticmethod
    def _save_two():
        store = RateStore()
        store.save("fp1", "cpu:k", {"rates": {"prefill_tok_s": 100.0, "decode_tok_s": 10.0}})
        store.save("fp2", "cpu:k", {"rates": {"prefill_tok_s": 200.0, "decode_tok_s": 20.0}})

    def test_saved_rates_load_back_in_a_new_store(self, own_cache):
        self._save_two()
        assert RateStore().lookup("fp1", "cpu:k")["rates"]["prefill_tok_s"] == 100.0
        assert set(RateStore().entries()) == {"fp1|cpu:k", "fp2|cpu:k"}

    def test_saving_leaves_only_the_rates_file(self, own_cache):
        self._save_two()
        assert [p.name for p in own_cache.iterdir()] == ["rates.json"]  # no temp file left behind

    @pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 99, "entries": {}}), "[]"])
    def test_unreadable_store_is_empty_with_a_warning(self, own_cache, caplog, content):
        own_cache.mkdir(parents=True)
        (own_cache / "rates.json").write_text(content)
        assert RateStore().entries() == {}
        assert "ignoring" in caplog.text


class TestFit:
    @pytest.mark.parametrize("points, alpha, beta", [
        ({1: 0.012, 2: 0.014, 4: 0.018}, 0.010, 0.002),  # exact line
        ({4: 0.02}, 0.0, 0.005),  # one point: through the origin
        ({1: 0.010, 2: 0.009, 3: 0.0095}, 0.0095, 0.0),  # falling: constant
        ({1: 0.001, 2: 0.004, 3: 0.007}, 0.0, 0.03 / 14),  # negative intercept: through the origin
    ])
    def test_table(self, points, alpha, beta):
        a, b = fit_step_model(points)
        assert (a, b) == pytest.approx((alpha, beta), abs=1e-6)
        assert a >= 0 and b >= 0

    def test_nothing_to_fit(self):
        with pytest.raises(ValueError):
            fit_step_model({})


class TestStepTable:
    def test_measured_points_become_a_table_with_gaps_interpolated(self):
        assert step_table({1: 1.0, 2: 1.5, 4: 2.5, 8: 3.0}) == (1.0, 1.5, 2.0, 2.5, 2.625, 2.75, 2.875, 3.0)
        assert step_table({2: 1.0, 4: 2.0}) == (), "without batch 1 there is no table"

    def test_a_step_uses_the_table_then_extends_it(self):
        # a GPU's cliff: 3 ms at 8, 4.6 ms at 9; alpha + beta*b would put both near 3.6 ms
        table = (1.2e-3, 1.6e-3, 1.8e-3, 2.0e-3, 2.3e-3, 2.6e-3, 2.8e-3, 3.0e-3, 4.6e-3, 4.7e-3)
        r = Rates(prefill_tok_s=5e4, decode_tok_s=3e3, step_alpha_s=1.0e-3, step_beta_s=0.3e-3, step_table=table)
        assert r.step_s(8) == 3.0e-3 and r.step_s(9) == 4.6e-3 and r.step_s(0) == 1.2e-3
        assert r.step_s(12) == pytest.approx(4.7e-3 + 2 * 0.3e-3)  # beyond the table: beta per sequence
        assert Rates(1.0, 1.0, step_table=(1.0, 3.0)).step_s(4) == pytest.approx(7.0)  # no beta: last slope
        alpha, beta, scaled = r.scaled(2.0)
        assert (alpha, beta, scaled[8]) == (2.0e-3, 0.6e-3, 9.2e-3)


class TestParseRates:
    def test_the_studys_cpu(self):
        name, r = parse_rates("cpu:prefill=73,decode=45")
        assert name == "cpu" and (r.prefill_tok_s, r.decode_tok_s, r.source) == (73, 45, "override")

    def test_with_step_model(self):
        _, r = parse_rates("gpu:prefill=2551,decode=293,alpha=0.01,beta=0.002")
        assert r.step_s(4) == pytest.approx(0.018)

    @pytest.mark.parametrize("spec", ["cpu", "cpu:prefill=73", ":prefill=1,decode=1", "cpu:prefill=x,decode=1",
                                      "cpu:prefill=0,decode=1", "cpu:prefill=1,decode=1,gamma=2", "cpu:prefill"])
    def test_bad_specs_say_the_format(self, spec):
        with pytest.raises(InvalidRequest, match="rates"):
            parse_rates(spec)


# ---- real model ----


class TestCalibrateOnTheTinyModel:
    def test_calibration_measures_a_backend_for_the_engine_to_load(self, make_engine, tiny_path):
        eng = make_engine()
        assert {b.rates.source for b in eng.backends.values()} == {"default"}
        b0 = eng.backends["cpu0"]
        seen = []
        cal = calibrate_backend(b0, progress=lambda d, t, what: seen.append((d, t, what)), **SMALL)
        assert [d for d, _, _ in seen] == list(range(1, 1 + 1 + 1 + 3)) and seen[-1][1] == 5
        assert cal.prefill_tok_s > 0 and math.isfinite(cal.prefill_tok_s)
        assert sorted(cal.step_s) == [1, 2, 3]
        assert all(s > 0 for s in cal.step_s.values())
        assert cal.step_alpha_s >= 0 and cal.step_beta_s >= 0
        assert cal.decode_tok_s == pytest.approx(3 / cal.step_s[3])
        assert cal.rates().step_table == (cal.step_s[1], cal.step_s[2], cal.step_s[3])  # the router's table
        assert b0.cap == 3 and b0.cache.cached_tokens == 0  # cap restored, cache flushed

        # the backend still serves after calibrating
        h = eng.submit(Request(tuple(range(300, 340)), SamplingParams(max_tokens=4, ignore_eos=True), backend="cpu0"))
        assert h.result(60).output_tokens == 4

        key = save_calibration(RateStore(), tiny_path, cal, "tiny")
        assert key == f"{file_fingerprint(tiny_path)}|{cal.config_key}"
        eng.close()

        again = make_engine()  # cpu0 and cpu1 have the same speed-relevant config: both pick it up
        for b in again.backends.values():
            assert b.rates == replace(cal.rates(), source="cached") and b.rates.origin == f"cached {cal.measured_at[:10]}"
        other = make_engine(["cpu:threads=2,cap=2,ctx=512"])
        assert other.backends["cpu"].rates == DEFAULT_RATES["cpu"]  # another config: not calibrated
        override = Rates(prefill_tok_s=73, decode_tok_s=45, source="override")
        pinned = make_engine(rates={"cpu1": override})
        assert pinned.backends["cpu1"].rates == override
        assert pinned.backends["cpu0"].rates.source == "cached"

    def test_prompt_shrinks_to_fit_a_small_context(self, make_engine):
        eng = make_engine(["cpu:threads=1,cap=2,ctx=256"])
        cal = calibrate_backend(eng.backends["cpu"], prompt_tokens=512, gen_tokens=8, repeats=1, batches=[1, 2])
        assert cal.prompt_tokens < 256
        assert any("shortened" in n for n in cal.notes)

    def test_context_term_is_timed_at_the_short_context(self, make_engine):
        eng = make_engine()
        seen = []
        cal = calibrate_backend(eng.backends["cpu0"], context_tokens=32, context_gen=8,
                                progress=lambda d, t, what: seen.append((d, t, what)), **SMALL)
        assert sorted(cal.context_step_s) == [1, 3] and cal.context_tokens == 32
        assert cal.context_cells == {1: 32 + 4 + 4, 3: 32 + 4 + 4}
        assert [d for d, _, _ in seen] == list(range(1, 10)) and seen[-2][2] == "cpu0: host cost per request"
        assert len(cal.admit_runs) == 1 and cal.admit_s >= 0 and cal.step_gamma_s >= 0

    def test_masked_scan_is_timed_with_unshared_prefixes(self, make_engine):
        """The short context's largest batch again, each sequence on a 32-token prefix of its
        own: the rows hold what the shared pass's rows held, the pool three times as much."""
        eng = make_engine()
        seen = []
        cal = calibrate_backend(eng.backends["cpu0"], context_tokens=32, context_gen=8,
                                progress=lambda d, t, what: seen.append((d, t, what)), **SMALL)
        assert seen[-1] == (9, 9, "cpu0: unshared prefixes, batch 3")
        assert cal.scan_batch == 3 and cal.scan_step_s > 0
        assert cal.context_kv[3] < cal.scan_kv and 3 * 32 < cal.scan_kv <= 3 * (32 + 4 + 8)  # three prefixes
        assert cal.step_delta_s >= 0
        assert any("masked-scan" in n for n in cal.notes) if not cal.step_delta_s else cal.step_kv
        assert cal.to_dict()["rates"]["step_delta_s"] == cal.step_delta_s

    def test_stored_context_term_loads_into_the_rates(self, make_engine, tiny_path):
        eng = make_engine()
        cal = calibrate_backend(eng.backends["cpu0"], context_tokens=32, context_gen=8, **SMALL)
        cal = replace(cal, step_gamma_s=2e-5, step_cells={b: 76.0 for b in cal.step_s})  # a term, whatever noise said
        save_calibration(RateStore(), tiny_path, cal, "tiny")
        rates = ModelRates(tiny_path).get(eng.backends["cpu0"].config, "cpu")
        assert (rates.step_gamma_s, rates.step_cells) == (2e-5, (76.0, 76.0, 76.0))
        assert rates.step_at(2, 76.0 + 10) == pytest.approx(rates.step_s(2) + 2 * 10 * 2e-5)

    def test_stored_masked_scan_loads_into_the_rates(self, make_engine, tiny_path):
        eng = make_engine()
        cal = calibrate_backend(eng.backends["cpu0"], context_tokens=32, context_gen=8, **SMALL)
        cal = replace(cal, step_delta_s=3e-6, step_kv={b: 40.0 * b for b in cal.step_s})  # a term, whatever noise said
        save_calibration(RateStore(), tiny_path, cal, "tiny")
        rates = ModelRates(tiny_path).get(eng.backends["cpu0"].config, "cpu")
        assert (rates.step_delta_s, rates.step_kv) == (3e-6, (40.0, 80.0, 120.0))
        assert rates.step_at(2, 0, 80.0 + 10) - rates.step_at(2, 0, 80.0) == pytest.approx(2 * 10 * 3e-6)

    def test_an_adaptive_cap_is_pinned_only_while_timing(self, make_engine):
        eng = make_engine(["cpu:threads=1,ctx=1024"])  # no cap: adaptive, starts at 4 of 16
        b = eng.backends["cpu"]
        cal = calibrate_backend(b, prompt_tokens=64, gen_tokens=8, repeats=1, batches=[1, 6])
        assert sorted(cal.step_s) == [1, 6]
        assert max(len(rows) for _, _, rows in b.step_log) == 6  # 6 ran together, above the adaptive start
        snap = b.snapshot()
        assert (b.cap_state().auto, snap.cap, snap.cap_ceiling, snap.cap_adaptive) == (True, 4, 16, True)

    def test_bad_sizes_are_refused(self, make_engine):
        eng = make_engine(["cpu:threads=1,cap=2,ctx=256"])
        with pytest.raises(InvalidRequest):
            calibrate_backend(eng.backends["cpu"], prompt_tokens=4)
        with pytest.raises(InvalidRequest):
            calibrate_backend(eng.backends["cpu"], batches=[0], **SMALL)

    def test_online_refresh_follows_observed_steps_except_overrides(self, make_engine):
        wrong = Rates(prefill_tok_s=1e7, decode_tok_s=1e6, step_alpha_s=1e-7, step_beta_s=1e-7, source="calibrated")
        typed = Rates(prefill_tok_s=73, decode_tok_s=45, source="override")
        eng = make_engine(rates={"cpu0": wrong, "cpu1": typed})
        refresh = OnlineRefresh(eng, weight=0.5, every=1).attach()
        try:
            sp = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
            handles = [eng.submit(Request(tuple(range(300 + k, 364 + k)), sp, backend=name))
                       for k, name in enumerate(["cpu0", "cpu0", "cpu1"])]
            for h in handles:
                assert h.result(60).error is None
            r0 = eng.backends["cpu0"].rates
            assert r0.source == "online"
            assert r0.step_beta_s > wrong.step_beta_s and r0.decode_tok_s < wrong.decode_tok_s  # slower than claimed
            assert r0.prefill_tok_s < wrong.prefill_tok_s
            assert r0.step_alpha_s / r0.step_beta_s == pytest.approx(1.0)  # scaled together
            assert eng.backends["cpu1"].rates == typed

            refresh.reset({"cpu0": wrong})
            assert eng.backends["cpu0"].rates == wrong
        finally:
            refresh.detach()


class TestCalibrateAtLoad:
    def test_placeholder_rates_are_measured_before_the_engine_serves(self, make_engine):
        eng = make_engine(calibrate=True)
        rates = {name: b.rates for name, b in eng.backends.items()}
        assert {r.origin for r in rates.values()} == {"measured at load"}
        r = rates["cpu0"]
        assert r.prefill_tok_s > 0 and math.isfinite(r.prefill_tok_s) and r.decode_tok_s > 0
        assert len(r.step_table) == 3 and r.measured_at  # batches 1 and the cap, interpolated between
        assert rates["cpu1"] == r  # the same speed-relevant config: measured once, applied to both
        assert not any(s.rates.placeholder for s in eng.snapshot())

    def test_rates_measured_at_load_are_stored_for_the_next_start(self, make_engine):
        first = make_engine(calibrate=True).backends["cpu0"].rates
        again = make_engine(calibrate=True).backends["cpu0"].rates
        assert again.origin == f"cached {first.measured_at[:10]}"
        assert (again.prefill_tok_s, again.decode_tok_s, again.step_table) == (
            first.prefill_tok_s, first.decode_tok_s, first.step_table)

    def test_backends_of_one_config_share_one_measurement(self, make_engine):
        said = []
        eng = make_engine([*SPECS, "cpu:threads=2,cap=2,ctx=512,name=big"], calibrate=True, status=said.append)
        assert len(said) == 2 and "cpu0" in said[0] and "big" in said[1]
        assert eng.backends["big"].rates.origin == "measured at load"
        assert len(RateStore().entries()) == 2

    def test_typed_rates_are_not_measured_at_load(self, make_engine):
        typed = Rates(prefill_tok_s=73, decode_tok_s=45, source="override")
        eng = make_engine(rates={"cpu0": typed, "cpu1": typed}, calibrate=True)
        assert {b.rates for b in eng.backends.values()} == {typed}
        assert RateStore().entries() == {}

    def test_without_calibrate_rates_stay_placeholders(self, make_engine):
        eng = make_engine()
        assert {b.rates.origin for b in eng.backends.values()} == {"placeholder"}

    def test_measuring_at_load_leaves_no_counts_behind(self, make_engine):
        eng = make_engine(calibrate=True)
        for s in eng.snapshot():
            assert s.rates.origin == "measured at load"
            assert (s.cache.query_tokens, s.cache.hit_tokens, s.cache.evictions) == (0, 0, 0), s.name
            assert (s.steps, s.prompt_tokens_computed, s.prefill_tok_s, s.decode_tok_s) == (0, 0, 0.0, 0.0), s.name
            assert s.cap_reason == "start", s.name  # as it started, not "set by the user"

    def test_reset_stats_zeroes_the_counts_but_not_the_cache(self, make_engine):
        eng = make_engine()
        prompt = tuple(range(300, 380))
        for _ in range(2):  # the second one hits the first one's cached prompt
            eng.submit(Request(prompt, SamplingParams(max_tokens=4))).result(60)
        before = eng.backend_snapshot("cpu0") if eng.backend_snapshot("cpu0").steps else eng.backend_snapshot("cpu1")
        assert before.cache.query_tokens > 0 and before.cache.cached_tokens > 0
        eng.reset_stats()
        after = eng.backend_snapshot(before.name)
        assert (after.cache.query_tokens, after.cache.hit_tokens, after.steps) == (0, 0, 0)
        assert after.cache.cached_tokens == before.cache.cached_tokens  # what is cached stays

    def test_the_engine_serves_after_measuring_at_load(self, make_engine):
        eng = make_engine(calibrate=True)
        h = eng.submit(Request(tuple(range(300, 340)), SamplingParams(max_tokens=4, ignore_eos=True)))
        assert h.result(60).output_tokens == 4


def test_snapshot_json_says_where_rates_came_from():
    from engine.core.snapshot import BackendSnapshot

    snap = BackendSnapshot(name="cpu", device="cpu", cap=4, n_ctx=512,
                           rates=Rates(100, 50, source="cached", measured_at="2026-11-30T10:00:00+00:00"))
    assert snap.to_dict()["rates"]["origin"] == "cached 2026-11-30"


class TestCommand:
    def test_the_calibrate_command_reports_what_it_stored(self, tiny_path, own_cache, capsys):
        rc = main(["calibrate", "--model", str(tiny_path), "--backend", "cpu:threads=1,cap=2,ctx=512",
                   "--backend", "cpu:threads=1,cap=2,ctx=512", "--prompt-tokens", "64", "--gen-tokens", "8",
                   "--repeats", "1"])
        assert rc == 0
        out = capsys.readouterr().out.strip().splitlines()
        assert out[1].startswith("| backend | device | threads | cap | prefill tok/s")
        assert out[3].startswith("| cpu0 | cpu | 1 | 2 |")
        assert any("cpu1: same speed-relevant config as cpu0" in line for line in out)
        final = json.loads(out[-1])
        assert final["fingerprint"] == file_fingerprint(tiny_path)
        assert final["store"] == str(own_cache / "rates.json")
        (b,) = final["backends"]  # the twins share one entry, measured once
        assert (b["backend"], b["also_for"]) == ("cpu0", ["cpu1"]) and sorted(b["step_s"]) == ["1", "2"]
        assert b["stored_as"] in RateStore().entries()

        assert main(["calibrate", "--list"]) == 0
        listing = capsys.readouterr().out
        assert "1 calibration(s)" in listing and "threads=1" in listing

    def test_unknown_backend_is_a_clear_error(self, tiny_path, capsys):
        rc = main(["calibrate", "--model", str(tiny_path), "--backend", "cpu:threads=1,cap=2,ctx=512",
                   "--only", "gpu", "--prompt-tokens", "64", "--gen-tokens", "8", "--repeats", "1"])
        assert rc == 2
        assert "unknown backend" in capsys.readouterr().err


def test_engine_load_can_refresh_rates_online(tiny_path):
    from engine.backends.config import parse_backend_specs
    from engine.core.request import Request, SamplingParams
    from engine.engine import Engine

    eng = Engine.load(tiny_path, parse_backend_specs(["cpu:threads=1,cap=2,ctx=1024"]), online_rates=True)
    try:
        b = eng.backends["cpu"]
        sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        for h in [eng.submit(Request(tuple(range(10, 50)), sp)) for _ in range(2)]:
            h.result(60)
        assert b.rates.source == "online"
    finally:
        eng.close()
    assert not eng.online.attached


def _serve_engine(tiny_path, *extra):
    from app.cli import parse_args
    from app.engine_setup import engine_from_args

    args = parse_args(["serve", "--model", str(tiny_path), "--backend", "cpu:threads=1,cap=2,ctx=512", *extra])
    return engine_from_args(args, progress=False)


def test_serve_measures_rates_at_load(tiny_path, capsys):
    with _serve_engine(tiny_path) as eng:
        assert eng.backends["cpu"].rates.origin == "measured at load"
    assert "tandem: measuring cpu's speed" in capsys.readouterr().err


def test_serve_without_calibration_keeps_placeholder_rates(tiny_path):
    with _serve_engine(tiny_path, "--no-calibrate") as eng:
        assert eng.backends["cpu"].rates.placeholder
