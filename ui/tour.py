"""A scripted tour of the app that saves the screenshots in docs/screenshots/.

    xvfb-run -a -s "-screen 0 1280x720x24" python -m app.gui --model default --tour docs/screenshots

The window takes the screen's size (1280x720: the compact layout, every panel a tab under the
chat). It loads the model, chats (one reply with a code block, to show the Markdown rendering),
shows the backends and controls, runs the study's workload (`--demo N`, 48 by default;
screenshots mid-run and after), steps the teaching replay to request 8, runs a small
experiment, and shows the latency view in the light theme (`light.png`). Every wait is an
`asyncio.sleep` on the qasync loop, so the window stays live the whole time.

`unhealthy.png` is not the tour's (its backends are all healthy): a remote backend at a port
nothing listens on is really down, so its card shows the connection error and Restart:

    xvfb-run -a -s "-screen 0 1280x720x24" python -m app.gui --model default \
        --backend cpu:threads=1,cap=4 --backend remote:url=http://127.0.0.1:9,name=laptop2 \
        --panel backends --delay 35 --screenshot docs/screenshots/unhealthy.png

`fleet-backends.png` and `fleet-routing.png` are not the tour's either: the app in front of two
engines (`python -m app serve --model synthetic:tiny --backend cpu:threads=1,cap=8 --port 18101`,
and the same on 18102), a demo still running when the window is saved:

    xvfb-run -a -s "-screen 0 1280x720x24" python -m app.gui \
        --backend remote:url=http://127.0.0.1:18101,name=a --backend remote:url=http://127.0.0.1:18102,name=b \
        --policy cache-aware --demo 96 --delay 2 --panel backends --screenshot docs/screenshots/fleet-backends.png

(`--panel routing` and `fleet-routing.png` for the other).

The chat's own screenshots (`--tour-only chat`): a 6-turn chat with a code block and a list, then
the Monitor drawer open mid-demo, named after the screen's height (`chat-720p.png`,
`monitor-720p.png`; run it at 1280x720 and at 1920x1080):

    xvfb-run -a -s "-screen 0 1920x1080x24" python -m app.gui --model default --tour docs/screenshots \
        --tour-only chat

`first-start.png`, `demo-warming.png` and `presenter-teaching.png` are `--tour-only first-start`
(a scratch `TANDEM_CACHE_DIR`, so the load measures the backends' speed as a first start does):

    TANDEM_CACHE_DIR=$(mktemp -d) xvfb-run -a -s "-screen 0 1280x720x24" python -m app.gui \
        --model default --tour docs/screenshots --tour-only first-start

`presenter.png` is the presenter view mid-demo, 24 study requests on two CPU backends:

    xvfb-run -a -s "-screen 0 1280x720x24" python -m app.gui --model default \
        --backend cpu:threads=1 --backend cpu:threads=1 --demo 24 --presenter --panel routing \
        --delay 35 --screenshot docs/screenshots/presenter.png

The lesson's (`--tour-only lesson`, docs/teaching.md): the load warming the lesson's prefix, its
rows before and after cpu0's ceiling is lowered, the rate turned up, another policy, a step, and
Focus monitor (`lesson-*.png`, `focus-monitor.png`):

    xvfb-run -a -s "-screen 0 1280x720x24" python -m app.gui --model default --tour docs/screenshots \
        --tour-only lesson

Then `pngquant --strip --quality=70-95` each PNG (a third of the size), then `optipng -o2`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from engine.lesson import lesson_specs


async def _until(predicate, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(step)
    return True


async def _load(window, args) -> None:
    from .loader import ModelSpec

    loaded: list = []
    window.engine_loaded.connect(loaded.append)
    window.load_model(ModelSpec(args.model, tuple(args.backend or ()), args.policy))
    if not await _until(lambda: bool(loaded), 300):
        raise SystemExit("the model did not load")
    await asyncio.sleep(1.0)


async def tour(window, out: Path, args) -> None:
    from .live_run import seed_workload

    def shot(name: str) -> None:
        path = window.save_screenshot(out / f"{name}.png")
        print(f"saved {path}", file=sys.stderr)

    await _load(window, args)

    chat = window.panels["chat"]
    chat.temperature.setValue(0.0)
    chat.max_tokens.setValue(160)
    chat.send("Write a Python function that returns the sum of a list of numbers. Use a Markdown code block.")
    await _until(lambda: not chat.busy, 300)
    chat.input.setPlainText("And what does a prefix cache change?")
    await asyncio.sleep(0.5)
    shot("main-idle")
    window.show_panel("backends")
    await asyncio.sleep(1.0)
    shot("backends")
    window.show_panel("controls")
    await asyncio.sleep(0.5)
    shot("controls")

    run = window.start_demo(seed_workload(args.demo or 48))
    routing = window.panels["routing"]
    window.show_panel("routing")
    # Mid-run: every request routed, the first ones finished, the queues still deep.
    await _until(lambda: routing.model.rowCount() >= run.spec.n_requests and len(run.result.records) >= 4, 300)
    await asyncio.sleep(args.delay or 2.0)
    rows = routing.model.rowCount()
    if rows:
        routing.select_row(rows - 1)
    await asyncio.sleep(0.3)
    shot("main-midrun")
    await _until(lambda: run is None or not run.running, 900)
    window.show_panel("latency")
    await asyncio.sleep(1.0)
    shot("latency")
    window.show_panel("routing")
    # Select the first request that went to the second backend, if any, to explain a switch.
    names = window.engine.backend_names
    pick = next((i for i, d in enumerate(routing.model.decisions) if len(names) > 1 and d.backend == names[1]), 0)
    routing.select_row(pick)
    routing.table.scrollTo(routing.model.index(pick, 0))
    await asyncio.sleep(0.5)
    shot("routing")

    window.show_panel("teaching")
    teaching = window.panels["teaching"]
    teaching.go(6)  # request 8: the CPU's score and the verdict
    teaching.use_article_rates()  # price the real queues as the article did
    teaching.run_live()
    await _until(lambda: teaching.run is not None and not teaching.run.running, 600)
    await asyncio.sleep(0.5)
    shot("teaching")
    window.panels["controls"].reset_rates()

    window.show_panel("experiments")
    ex = window.panels["experiments"]
    ex.n_requests.setValue(8)
    policies = ["seed-score", "predicted-finish", f"only:{names[0]}"]
    for name, box in ex.policy_checks.items():
        box.setChecked(name in policies)
    ex.start(policies)
    await _until(lambda: not ex.running, 1800)
    await asyncio.sleep(0.5)
    shot("experiments")

    await whatif(window, out)
    window.set_theme("light")
    window.show_panel("latency")
    await asyncio.sleep(1.0)
    shot("light")


async def whatif(window, out: Path, args=None) -> None:
    """The Teaching panel's What if tab: the study on the M2 profile, simulated, beside a live
    run of the same eight requests here and its simulation. With `args`, loads the model first
    (`--tour-only whatif`)."""
    if args is not None:
        await _load(window, args)
    window.show_panel("teaching")
    teaching = window.panels["teaching"]
    teaching.tabs.setCurrentWidget(teaching.whatif)
    panel = teaching.whatif
    panel.profile_box.setCurrentText("study-m2")
    panel.n_box.setValue(8)
    panel.simulate()  # the M2's rows first, then the live run and its simulation below them
    await _until(lambda: panel.worker is not None and not panel.worker.running, 300)
    panel.run_live()
    await _until(lambda: any(r["run"] == "sim: this machine" for r in panel.rows), 900)
    await asyncio.sleep(0.5)
    path = window.save_screenshot(out / "whatif.png")
    print(f"saved {path}", file=sys.stderr)


CHAT_TURNS = (
    "In one sentence: what is a prefix cache?",
    "Write a Python function that returns the sum of a list of numbers. Use a Markdown code block.",
    "Give me three tips for fast local inference, as a Markdown bulleted list.",
    "What does TTFT mean?",
    "Is a GPU always faster than a CPU for a small model?",
    "Thanks! Say goodbye in five words.",
)


async def chat_tour(window, out: Path, args) -> None:
    """Six turns of chat (a code block and a list among the replies), saved as
    `chat-<height>p.png`; then a demo with the Monitor open, `monitor-<height>p.png`."""
    from .live_run import seed_workload

    await _load(window, args)
    tag = f"{window.height()}p"  # the window fills the screen: 720p, 1080p
    chat = window.panels["chat"]
    chat.temperature.setValue(0.0)
    chat.max_tokens.setValue(80)
    for text in CHAT_TURNS:
        chat.send(text)
        await _until(lambda: not chat.busy, 300)
    # From the second question on: the code block, the list and the turns after them.
    bubble = chat.bubble(2)
    chat.transcript.verticalScrollBar().setValue(bubble.y() - 8)
    await asyncio.sleep(1.0)
    path = window.save_screenshot(out / f"chat-{tag}.png")
    print(f"saved {path}", file=sys.stderr)

    run = window.start_demo(seed_workload(args.demo or 48))
    window.show_panel("routing")
    routing = window.panels["routing"]
    await _until(lambda: routing.model.rowCount() >= 12 and len(run.result.records) >= 2, 300)
    await asyncio.sleep(args.delay or 1.5)
    path = window.save_screenshot(out / f"monitor-{tag}.png")
    print(f"saved {path}", file=sys.stderr)
    window.stop_demo()
    await _until(lambda: not run.running, 300)


async def first_start(window, out: Path, args) -> None:
    """The first start's screen mid-measurement, a demo's warming phase (one backend's worker held
    in a call until the picture is taken, so the phase is on screen however fast the machine),
    and Teaching in the presenter view after the demo."""
    import threading

    from .live_run import seed_workload
    from .loader import ModelSpec

    def shot(name: str) -> None:
        path = window.save_screenshot(out / f"{name}.png")
        print(f"saved {path}", file=sys.stderr)

    loaded: list = []
    steps: list = []
    window.engine_loaded.connect(loaded.append)
    window.loader.step.connect(lambda done, total, what: steps.append(done))
    window.load_model(ModelSpec(args.model, tuple(args.backend or ()), args.policy))
    if await _until(lambda: len(steps) >= 2 or bool(loaded), 300) and not loaded:
        await asyncio.sleep(1.0)  # the time line and the estimate filled in
        shot("first-start")
    else:
        print("first-start: the rates were stored already, no measuring phase to show", file=sys.stderr)
    if not await _until(lambda: bool(loaded), 300):
        raise SystemExit("the model did not load")
    await asyncio.sleep(1.0)

    engine = window.engine
    gate = threading.Event()
    held = engine.backend(engine.backend_names[-1]).call(lambda _b: gate.wait(60))
    run = window.start_demo(seed_workload(args.demo or 8))
    window.show_panel("routing")
    await asyncio.sleep(1.5)
    shot("demo-warming")
    gate.set()
    held.result(60)
    await _until(lambda: run is None or not run.running, 900)
    window.set_presenter(True)
    window.show_panel("teaching")
    window.panels["teaching"].go(6)  # request 8: the chart's bars, the CPU's line and the verdict
    await asyncio.sleep(1.5)
    shot("presenter-teaching")
    window.set_presenter(False)


async def lesson_tour(window, out: Path, args) -> None:
    """The lesson docs/teaching.md walks through, as a teacher runs it at 1280x720: the load
    warming the lesson's prefix, the first rows, cpu0's ceiling lowered and the rows after it,
    the rate turned up, another policy, a paused step, and the Monitor with the whole height.
    The lesson runs on the window's own timer meanwhile; each picture waits for the rows it shows."""
    from .loader import ModelSpec

    def shot(name: str) -> None:
        path = window.save_screenshot(out / f"{name}.png")
        print(f"saved {path}", file=sys.stderr)

    started: list = []
    phases: list = []
    window.lessons.started.connect(started.append)
    window.loader.phase.connect(phases.append)
    specs = tuple(args.backend or ()) or tuple(lesson_specs(bool(window.gpu_offload)))
    window.load_model(ModelSpec(args.model, specs, args.policy, lesson=True))
    if await _until(lambda: "warming" in phases or bool(started), 300) and not started:
        await asyncio.sleep(0.5)
        shot("lesson-loading")
    if not await _until(lambda: bool(started), 300):
        raise SystemExit("the lesson did not start")
    run = started[0]
    bar, routing = window.lessons.bar, window.panels["routing"]
    names = window.engine.backend_names

    async def rows(n: int) -> None:
        await _until(lambda: routing.model.rowCount() >= n, 300)

    def select_last(backend: str | None = None) -> None:
        ds = routing.model.decisions
        pick = max((i for i, d in enumerate(ds) if backend is None or d.backend == backend), default=len(ds) - 1)
        routing.select_row(pick)

    await rows(6)
    select_last()
    await asyncio.sleep(0.5)
    shot("lesson-rows")
    routing.table.clearSelection()  # the table follows the new rows again
    bar.ceilings[names[0]].setValue(1)  # the hint's first suggestion
    mark = routing.model.rowCount()
    await rows(mark + 8)
    select_last(names[1])
    await asyncio.sleep(0.5)
    shot("lesson-after-cap")
    routing.table.clearSelection()
    bar.change_rate(up=True)
    bar.change_rate(up=True)
    window.show_panel("backends")
    await asyncio.sleep(10.0)
    shot("lesson-rate")
    bar.policy_combo.setCurrentText("round-robin")
    await asyncio.sleep(12.0)
    window.show_panel("latency")
    await asyncio.sleep(1.0)
    shot("lesson-policy")
    window.show_panel("routing")
    run.pause()
    run.step()
    await asyncio.sleep(0.5)
    select_last()
    await asyncio.sleep(0.5)
    shot("lesson-step")
    run.resume()
    window.show_panel("experiments")
    await asyncio.sleep(1.0)
    shot("focus-monitor")
    window.lessons.stop()
    await asyncio.sleep(1.0)
