"""Process settings for long-running commands (the app, the server, the soak).

**The GIL's switch interval.** Backend workers share the interpreter with a UI or an HTTP
server; each decode step must win the GIL back after `llama_decode`, and while another thread
runs Python that takes up to one interval (Python's default 5 ms is longer than a GPU step).
`tandem bench overhead --busy-thread` and `tandem bench ui` measure it (docs/performance.md).

**Freed heap back to the system (glibc only).** glibc keeps memory freed by a thread in that thread's arena and returns it to the system only
from the top of the main heap. With a dozen backend, HTTP and client threads, RSS then wanders
by tens of MB with no leak behind it (the 30-minute soak: +9 % at the end, −21 % after one
`malloc_trim`). Limiting glibc to two arenas made it creep instead (+17 % in 15 minutes,
`docs/results/soak-30min-arenas-2-aborted/`). A `malloc_trim(0)` every half minute, on a daemon
thread, keeps RSS at what is in use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import threading

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.001


def settle_for_serving() -> None:
    """What `gui`, `serve` and `bench soak` run with: a short switch interval, heap trimming."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    start_heap_trimmer()


def start_heap_trimmer(interval_s: float = 30.0) -> threading.Event | None:
    """Start the trimming thread; set the returned event to stop it. None where not glibc."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return None
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval_s):
            trim(0)

    threading.Thread(target=run, name="heap-trimmer", daemon=True).start()
    return stop
