"""On the GPU machine: one backend per GPU through llama.cpp's device list, checked for real.

`source .gpukit/enter.sh && python3 scripts/gpu/devices.py` — prints what ggml lists, loads
the tiny synthetic model on each GPU alone (`gpuN`) beside a CPU backend, generates, and checks
each backend's snapshot names its device and reports that GPU's memory. Exits non-zero on
any mismatch. Works on one GPU or several.
"""

from __future__ import annotations

import logging
import sys

sys.path.insert(0, ".")

import engine.llama  # noqa: F401  (llama.cpp before numpy)
from engine import llama
from engine.backends.config import default_specs, parse_backend_specs
from engine.core.errors import ModelLoadError
from engine.core.request import SamplingParams
from engine.engine import Engine

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
fail = []


def check(ok: bool, what: str) -> None:
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        fail.append(what)


print("devices:", llama.describe_devices())
n = llama.gpu_count()
check(n >= 1, f"{n} GPU(s) listed")
for d in llama.gpus():
    free, total = d.memory()
    check(0 < free <= total, f"{d.name} memory {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
specs = default_specs(gpu=llama.gpu_offload_supported(), cores=16)
print("default specs:", specs)
check((n >= 2) == specs[0].startswith("gpu:device=0"), "defaults: one backend per GPU when several")
try:
    llama.pick_device(f"gpu{n}")
    check(False, f"gpu{n} refused")
except ModelLoadError as e:
    check(f"GPU {n} asked for" in str(e), f"gpu{n} refused: {e}")

configs = parse_backend_specs([f"gpu:device={k},cap=4,ctx=2048" for k in range(n)] + ["cpu:threads=4,cap=2,ctx=2048"])
with Engine.load("synthetic:tiny", configs) as eng:
    for c in configs:
        h = eng.generate(list(range(1, 40)), SamplingParams(max_tokens=8, ignore_eos=True), backend=c.name)
        rec = h.result(120)
        check(rec.error is None and rec.output_tokens == 8, f"{c.name} generated {rec.output_tokens} tokens ({rec.error})")
    for s in eng.snapshot():
        b = eng.backends[s.name]
        print(f"  {s.name}: device {s.device} ({s.device_name}), model spec {b.model.spec}, "
              f"memory {s.device_memory_free_bytes / 2**30:.1f}/{s.device_memory_total_bytes / 2**30:.1f} GiB")
        if s.name.startswith("gpu"):
            k = int(s.name[3:])
            check(s.device_name == llama.gpus()[k].name, f"{s.name} is on {llama.gpus()[k].name}")
            check(s.device_memory_total_bytes == llama.gpus()[k].memory()[1], f"{s.name} reports its GPU's memory")
        else:
            check(s.device_memory_total_bytes == 0 and s.device_name == "CPU", f"{s.name} reports no GPU memory")
print("FAILED:", fail if fail else "nothing")
sys.exit(1 if fail else 0)
