"""Backend specs that pick a GPU, device enumeration, default backends per GPU count.

This machine's llama.cpp is a CPU build: ggml lists one CPU device and no GPU, so asking for a
GPU must fail clearly, naming what exists. The GPU run exercises the real `gpu:device=N` path.
"""

from __future__ import annotations

import pytest

from engine import llama
from engine.backends.config import default_specs, parse_backend_spec, parse_backend_specs
from engine.core.errors import InvalidRequest, ModelLoadError
from engine.llama.model import Model, ModelRegistry

# ---- spec grammar ----


SPEC_CASES = [
    # (spec, device, name)
    ("gpu:device=0", "gpu0", "gpu0"),
    ("gpu:device=1,cap=8", "gpu1", "gpu1"),
    ("gpu:cap=8,device=3,name=big", "gpu3", "big"),
    ("gpu", "gpu", "gpu"),
    ("cpu:threads=2", "cpu", "cpu"),
]


@pytest.mark.parametrize("spec,device,name", SPEC_CASES)
def test_parse_gpu_device(spec, device, name):
    c = parse_backend_spec(spec)
    assert (c.device, c.name) == (device, name)


BAD_SPECS = [
    ("cpu:device=1", "needs a gpu spec"),
    ("auto:device=0", "needs a gpu spec"),
    ("gpu:device=x", "GPU number"),
    ("gpu:device=-1", "GPU number"),
    ("gpu:devcie=1", "unknown key 'devcie'"),
]


@pytest.mark.parametrize("spec,words", BAD_SPECS)
def test_bad_gpu_device_spec(spec, words):
    with pytest.raises(InvalidRequest, match=words):
        parse_backend_spec(spec)


def test_names_one_backend_per_gpu():
    configs = parse_backend_specs(["gpu:device=0", "gpu:device=1", "cpu"])
    assert [(c.name, c.device) for c in configs] == [("gpu0", "gpu0"), ("gpu1", "gpu1"), ("cpu", "cpu")]
    # A plain gpu beside a chosen one keeps its name; two contexts on one GPU are numbered.
    assert [c.name for c in parse_backend_specs(["gpu", "gpu:device=1"])] == ["gpu", "gpu1"]
    assert [c.name for c in parse_backend_specs(["gpu:device=1", "gpu:device=1"])] == ["gpu10", "gpu11"]
    with pytest.raises(InvalidRequest, match="unique"):
        parse_backend_specs(["gpu:device=1", "cpu:name=gpu1"])


# ---- default backends ----


DEFAULT_CASES = [
    # (gpu offload, GPU count, cores, specs)
    (False, 0, 8, ["cpu:threads=8,cap=8"]),
    (False, 0, 2, ["cpu:threads=2,cap=8"]),
    (True, 1, 8, ["gpu", "cpu:threads=7"]),
    (True, 2, 16, ["gpu:device=0", "gpu:device=1", "cpu:threads=14"]),
    (True, 4, 2, ["gpu:device=0", "gpu:device=1", "gpu:device=2", "gpu:device=3",
                  "cpu:threads=1"]),
]


@pytest.mark.parametrize("gpu,gpus,cores,specs", DEFAULT_CASES)
def test_default_specs_per_gpu_count(gpu, gpus, cores, specs):
    assert default_specs(gpu, cores=cores, gpus=gpus) == specs
    parse_backend_specs(specs)  # every default parses


def test_default_specs_count_gpus_here():
    # This CPU build has no GPU: the count is 0 and the default is one backend on every core.
    assert llama.gpu_count() == 0
    assert default_specs(gpu=False, cores=4) == ["cpu:threads=4,cap=8"]
    names = [c.name for c in parse_backend_specs(default_specs(gpu=False, cores=4))]
    assert names == ["cpu"]


# ---- devices ----


def test_devices_list_the_cpu_here():
    found = llama.devices()
    assert [d.kind for d in found] == ["cpu"]
    cpu = found[0]
    assert cpu.index == 0 and cpu.name == "CPU" and cpu.description and cpu.handle
    free, total = cpu.memory()
    assert 0 < free <= total
    assert llama.gpus() == []
    assert "CPU (cpu: " in llama.describe_devices()


def test_asking_for_a_missing_gpu_names_what_exists():
    with pytest.raises(ModelLoadError, match=r"GPU 1 asked for, but this host has no GPU \(devices: CPU"):
        llama.gpu(1)
    with pytest.raises(ModelLoadError, match="devices here: CPU"):
        llama.pick_device("gpu1")
    with pytest.raises(ModelLoadError, match="cpu, gpu, gpuN or auto"):
        llama.pick_device("tpu")
    assert llama.gpu_index("gpu12") == 12 and llama.gpu_index("gpu") is None and llama.gpu_index("gpux") is None


def test_loading_on_a_missing_gpu_fails_clearly(tiny_path):
    with pytest.raises(ModelLoadError, match=r"gpu1 asked for.*devices here: CPU"):
        Model(tiny_path, "gpu1")
    with pytest.raises(ModelLoadError, match="gpu1 asked for"):
        ModelRegistry().acquire(tiny_path, "gpu1")


def test_cpu_model_reports_no_device_memory(tiny_model):
    assert tiny_model.spec == "cpu" and tiny_model.gpu_index is None
    assert tiny_model.memory.read() == (0, 0)
    assert tiny_model.info.device_name == "CPU"


def test_memory_probe_reads_at_most_every_max_age():
    now = [0.0]
    cpu = llama.devices()[0]
    probe = llama.MemoryProbe([cpu], max_age_s=1.0, clock=lambda: now[0])
    first = probe.read()
    assert first[1] == cpu.memory()[1] and first[0] > 0
    now[0] = 0.5
    assert probe.read() is first  # the cached answer, until it is a second old
    now[0] = 1.5
    again = probe.read()
    assert again is not first and again[1] == first[1]
    assert llama.MemoryProbe([]).read() == (0, 0)


def test_registry_keys_by_device(tiny_path):
    reg = ModelRegistry()
    a = reg.acquire(tiny_path, "cpu")
    b = reg.acquire(tiny_path, "cpu")
    assert a is b
    reg.release(a)
    assert a.ptr  # one user left
    reg.release(b)
    assert a.ptr is None  # freed with its last user


def test_snapshot_reports_device_memory_fields(tiny_model, make_backend):
    snap = make_backend(tiny_model, name="c", device="cpu").snapshot()
    assert (snap.device_memory_free_bytes, snap.device_memory_total_bytes) == (0, 0)
    assert snap.device_name == "CPU"
    d = snap.to_dict()
    assert d["device_memory_free_bytes"] == 0 and d["device_memory_total_bytes"] == 0


def test_engine_with_a_missing_gpu_fails_clearly(tiny_path):
    from engine.engine import Engine

    with pytest.raises(ModelLoadError, match=r"gpu1 asked for.*devices here: CPU"):
        Engine.load(tiny_path, parse_backend_specs(["cpu:threads=1,cap=1,ctx=512", "gpu:device=1"]))


def test_contexts_of_one_spec_serve_on_one_shared_model(tiny_path):
    from engine.core.request import Request, SamplingParams
    from engine.engine import Engine

    eng = Engine.load(tiny_path, parse_backend_specs(["cpu:threads=1,cap=2,ctx=512,contexts=2"]), calibrate=False)
    try:
        a, b = eng.backends["cpu-a"], eng.backends["cpu-b"]
        assert a.model is b.model
        assert a.snapshot().group == b.snapshot().group == "cpu"  # one device: the default policy's grouping
        for backend in (a, b):
            assert backend.enqueue(Request((9, 4, 17), SamplingParams(max_tokens=4))).result(60).status.finished
    finally:
        eng.close()


def test_a_cpu_model_of_a_quantized_type_decodes_a_prompt_batch():
    """ggml's AMX kernel for repacked weights crashes (SIGSEGV) on some AMX machines as soon as a
    batch holds several tokens; CPU models skip weight repacking on AMX CPUs. In a child process,
    so that a crash fails this test instead of the run."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "app", "generate", "--model", "synthetic:tiny:q8_0",
                        "--prompt", "one two three four five six seven eight", "--max-tokens", "4"],
                       capture_output=True, text=True, timeout=240, env=llama.child_env())
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
