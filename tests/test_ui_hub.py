"""Get model: searching, listing, pricing and downloading GGUF models through `huggingface_hub`,
against a local server that speaks the Hub's API (`tests/fake_hub.py`; `HF_ENDPOINT` points at
it: the tests have no internet). The file served is a real GGUF (the tiny synthetic model), so
the header read by range and the model loaded after the download are real too; a model in parts
is that model cut by gguf's own writer, and llama.cpp loads it from its first part."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
from fake_hub import FakeHub, split_gguf
from ui_fixtures import WAIT_MS, make_window, qasync_loop, ui_engine  # noqa: F401

from engine.llama.model import resolve_model

REPO = "tester/Tiny-GGUF"


@pytest.fixture(scope="module")
def tiny_bytes():
    return resolve_model("synthetic:tiny").read_bytes()


@pytest.fixture(scope="module")
def tiny_parts(tmp_path_factory):
    """The tiny model in three parts: {file name: bytes}."""
    folder = tmp_path_factory.mktemp("parts")
    return {p.name: p.read_bytes() for p in split_gguf(resolve_model("synthetic:tiny"), folder, 3)}


SPLIT_DIR = "parts/"


@pytest.fixture
def fake_hub(tiny_bytes, tiny_parts, monkeypatch, tmp_path):
    hub_server = FakeHub()
    hub_server.add(REPO, {"tiny-Q8_0.gguf": tiny_bytes, "sub/tiny-F16.gguf": tiny_bytes + b"\0" * 4096,
                          "mmproj-tiny-f16.gguf": tiny_bytes[:4096],
                          "big-00001-of-00002.gguf": tiny_bytes[:1024],  # its second part is missing
                          "README.md": b"# tiny",
                          **{SPLIT_DIR + name: data for name, data in tiny_parts.items()}},
                   downloads=10)
    hub_server.add("tester/Other-GGUF", {"other.Q4_K_M.gguf": tiny_bytes}, downloads=99)
    hub_server.add("tester/no-gguf-here", {"model.safetensors": b"x" * 10})
    monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token or cache of the user's
    import huggingface_hub.constants as constants  # read HF_ENDPOINT when first imported: follow it

    monkeypatch.setattr(constants, "ENDPOINT", hub_server.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        hub_server.url + "/{repo_id}/resolve/{revision}/{filename}")
    yield hub_server
    hub_server.close()


def test_search_lists_gguf_repositories_most_downloaded_first(fake_hub):
    from ui.model import hub

    found = hub.search_models("gguf")
    assert [m.repo_id for m in found] == ["tester/Other-GGUF", REPO]
    assert found[0].downloads == 99
    assert any(path == "/api/models" for _m, path, _r in fake_hub.requests)


def test_listing_keeps_single_file_models_with_their_size_sha256_quant(fake_hub, tiny_bytes, tiny_parts):
    from ui.model import hub

    files = hub.gguf_files(REPO)
    assert [f.path for f in files if not f.parts] == ["tiny-Q8_0.gguf", "sub/tiny-F16.gguf"]  # smallest first
    assert files[0].size == len(tiny_bytes) and files[0].sha256 == FakeHub.sha256(tiny_bytes)
    assert [f.quant for f in files if not f.parts] == ["Q8_0", "F16"]
    assert [f.size for f in files] == sorted(f.size for f in files)
    with pytest.raises(hub.HubError, match="listing tester/missing failed"):
        hub.gguf_files("tester/missing")


def test_a_model_in_parts_is_one_entry_with_the_parts_total(fake_hub, tiny_parts):
    from ui.model import hub

    split = [f for f in hub.gguf_files(REPO) if f.parts]
    assert len(split) == 1  # the three parts as one model; "big" (a part missing) is not offered
    f = split[0]
    names = sorted(tiny_parts)
    assert [p.path for p in f.parts] == [SPLIT_DIR + n for n in names] and f.path == SPLIT_DIR + names[0]
    assert f.size == sum(len(b) for b in tiny_parts.values())
    assert [p.sha256 for p in f.parts] == [FakeHub.sha256(tiny_parts[n]) for n in names]
    assert f.label == SPLIT_DIR + "synthetic-tiny-f16 (3 parts)"
    shape = hub.model_shape(f)  # the header is in the first part
    assert shape is not None and shape.n_layers > 0
    fit = hub.fits(f, shape, 512, hub.Memory(1 << 40, 1 << 40))
    assert fit.ram == "fits" and fit.need > f.size  # priced at the total
    assert hub.fits(f, shape, 512, hub.Memory(f.size, f.size // 2)).ram == "too big"


def test_a_model_in_parts_is_downloaded_whole_then_loaded_from_its_first_part(fake_hub, tiny_parts, tmp_path):
    from engine.backends.config import parse_backend_specs
    from engine.engine import Engine
    from ui.model import hub

    f = next(f for f in hub.gguf_files(REPO) if f.parts)
    seen = []
    path = hub.download(f, tmp_path, progress=lambda done, total: seen.append((done, total)))
    folder = tmp_path / "tester--Tiny-GGUF" / SPLIT_DIR
    assert path == folder / sorted(tiny_parts)[0]
    assert {p.name: p.read_bytes() for p in folder.glob("*.gguf")} == tiny_parts
    assert seen[-1] == (f.size, f.size) and all(t == f.size for _d, t in seen)
    assert [d for d, _t in seen] == sorted(d for d, _t in seen)  # one bar over all the parts
    assert not list((tmp_path / "tester--Tiny-GGUF" / hub.PARTIAL_DIR).rglob("*.*"))  # nothing left partial
    eng = Engine.load(str(path), parse_backend_specs(["cpu:threads=1,cap=1,ctx=256"]))  # llama.cpp finds the rest
    try:
        assert eng.model.n_vocab > 0 and os.path.samefile(eng.model.path, path)
    finally:
        eng.close()


def test_the_shape_comes_from_the_header_read_by_range(fake_hub, tiny_bytes):
    from gguf import GGUFReader

    from ui.model import hub

    f = hub.gguf_files(REPO)[0]
    shape = hub.model_shape(f)
    assert shape is not None
    reader = GGUFReader(str(resolve_model("synthetic:tiny")), "r")
    arch = reader.get_field("general.architecture").contents()
    assert shape.architecture == arch
    assert shape.n_layers == reader.get_field(f"{arch}.block_count").contents()
    assert shape.n_kv_heads == reader.get_field(f"{arch}.attention.head_count_kv").contents()
    ranged = [r for m, p, r in fake_hub.requests if p.endswith("/tiny-Q8_0.gguf") and m == "GET"]
    assert ranged and all(r.startswith("bytes=") for r in ranged)  # never the whole file
    # KV grows with the context, and so does what the model needs
    small = hub.fits(f, shape, 512, hub.Memory(1 << 40, 1 << 40))
    large = hub.fits(f, shape, 65536, hub.Memory(1 << 40, 1 << 40))
    assert large.kv == 128 * small.kv and large.need > small.need
    assert small.ram == "fits" and small.vram == "no GPU"
    assert hub.fits(f, shape, 512, hub.Memory(small.need * 2, small.need // 2)).ram == "tight"
    assert hub.fits(f, shape, 512, hub.Memory(small.need // 2, small.need // 4, small.need * 2)).ram == "too big"
    assert hub.fits(f, shape, 512, hub.Memory(small.need // 2, small.need // 4, small.need * 2)).vram == "fits"


def test_a_dropped_connection_resumes_where_it_stopped(fake_hub, tiny_bytes, tmp_path,
                                                                              monkeypatch):
    import huggingface_hub.constants as constants

    from ui.model import hub

    # huggingface_hub writes (and can resume from) whole 10 MB chunks; the tiny file needs smaller ones
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 << 10)
    f = hub.gguf_files(REPO)[0]
    third = len(tiny_bytes) // 3
    fake_hub.cut_after = third  # the connection drops a third of the way
    seen = []
    path = hub.download(f, tmp_path, progress=lambda done, total: seen.append((done, total)))
    assert path.read_bytes() == tiny_bytes
    assert path.parent.name == "tester--Tiny-GGUF" and path.parent.parent == tmp_path
    gets = [r for m, p, r in fake_hub.requests if m == "GET" and p.endswith("tiny-Q8_0.gguf")]
    assert len(gets) == 2 and gets[0] == ""
    resumed_at = int(gets[1].removeprefix("bytes=").rstrip("-"))
    assert third - (16 << 10) < resumed_at <= third  # the rest, from the last chunk written
    assert seen[-1] == (len(tiny_bytes), len(tiny_bytes))
    assert [d for d, _t in seen] == sorted(d for d, _t in seen)  # progress only goes forward


def test_a_file_that_does_not_match_its_checksum_is_deleted(fake_hub, tmp_path):
    from ui.model import hub

    f = hub.gguf_files(REPO)[0]
    fake_hub.corrupt.add(f.path)
    with pytest.raises(hub.HubError, match="sha256"):
        hub.download(f, tmp_path)
    assert not (tmp_path / "tester--Tiny-GGUF" / f.path).exists()


def test_a_cancelled_download_stops(fake_hub, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    from ui.model import hub

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 << 10)  # several chunks: stop after the first

    f = hub.gguf_files(REPO)[0]
    cancel = threading.Event()

    def progress(done, total):
        if done:
            cancel.set()  # stop at the first bytes

    with pytest.raises(hub.DownloadCancelled):
        hub.download(f, tmp_path, progress=progress, cancel=cancel)
    assert not (tmp_path / "tester--Tiny-GGUF" / f.path).exists()


STOP_AT = 3 * (64 << 10)  # the fake Hub holds still after this many bytes; whole 16 KiB chunks


def _served_after(fake_hub, path: str, start: int) -> int:
    return fake_hub.served.get((path, f"bytes={start}-"), 0)


def test_a_stopped_download_resumes_from_the_bytes_on_disk(fake_hub, tiny_bytes, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants
    from waiting import wait_until

    from ui.model import hub

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 << 10)  # the file is written as it comes
    f = hub.gguf_files(REPO)[0]
    partial = hub.partial_path(f, tmp_path / "tester--Tiny-GGUF")
    fake_hub.stall_after = STOP_AT
    cancel = threading.Event()
    stopped = []
    thread = threading.Thread(target=lambda: stopped.append(_raises(hub.download, f, tmp_path, cancel=cancel)))
    thread.start()
    try:
        assert fake_hub.stalled.wait(30)
        wait_until(lambda: partial.is_file() and partial.stat().st_size == STOP_AT, 30, "the first bytes written")
        cancel.set()  # Stop (or the dialog closed)
    finally:
        fake_hub.release.set()
    thread.join(30)
    assert stopped and isinstance(stopped[0], hub.DownloadCancelled)
    assert partial.stat().st_size == STOP_AT and hub.partial_bytes(f, tmp_path) == STOP_AT  # kept
    assert not (tmp_path / "tester--Tiny-GGUF" / f.path).exists()

    seen = []
    path = hub.download(f, tmp_path, progress=lambda done, total: seen.append(done))
    assert path.read_bytes() == tiny_bytes  # and its sha256 was checked
    assert _served_after(fake_hub, f.path, STOP_AT) == len(tiny_bytes) - STOP_AT  # only the rest was fetched
    assert seen[0] == STOP_AT and seen[-1] == len(tiny_bytes)
    assert not partial.exists()


def test_a_download_killed_with_the_app_resumes_next_time(fake_hub, tiny_bytes, tmp_path):
    """The app closed (its process killed) in the middle of a download: the next start fetches the rest."""
    from waiting import wait_until

    from ui.model import hub

    f = hub.gguf_files(REPO)[0]
    partial = hub.partial_path(f, tmp_path / "tester--Tiny-GGUF")
    fake_hub.stall_after = STOP_AT
    script = ("import sys, huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = 16 << 10\n"
              "from pathlib import Path\nfrom ui.model import hub\n"
              f"f = hub.gguf_files({REPO!r})[0]\nhub.download(f, Path(sys.argv[1]))\n")
    env = {**os.environ, "HF_ENDPOINT": fake_hub.url, "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HOME": str(tmp_path / "hf-home")}
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], env=env,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        assert fake_hub.stalled.wait(60), "the download did not start"
        wait_until(lambda: partial.is_file() and partial.stat().st_size == STOP_AT, 30, "the first bytes written")
        proc.kill()
        assert proc.wait(30) != 0
    finally:
        fake_hub.release.set()
        if proc.poll() is None:
            proc.kill()
    on_disk = partial.stat().st_size
    assert on_disk == STOP_AT
    path = hub.download(f, tmp_path)
    assert path.read_bytes() == tiny_bytes
    assert _served_after(fake_hub, f.path, on_disk) == len(tiny_bytes) - on_disk
    starts = [r for m, p, r in fake_hub.requests if m == "GET" and p.endswith(f.path)]
    assert starts == ["", f"bytes={on_disk}-"]  # the whole file once, then only the rest


def test_a_resumed_file_that_does_not_match_its_checksum_is_deleted(fake_hub, tiny_bytes, tmp_path):
    from ui.model import hub

    f = hub.gguf_files(REPO)[0]
    partial = hub.partial_path(f, tmp_path / "tester--Tiny-GGUF")
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"\xff" * 1000)  # bytes that are not the file's beginning
    with pytest.raises(hub.HubError, match="sha256"):
        hub.download(f, tmp_path)
    assert _served_after(fake_hub, f.path, 1000) == len(tiny_bytes) - 1000
    assert not partial.exists() and not (tmp_path / "tester--Tiny-GGUF" / f.path).exists()
    assert hub.download(f, tmp_path).read_bytes() == tiny_bytes  # the next try starts over


def _raises(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as e:
        return e
    return None


def test_the_search_fails_with_a_message_when_the_hub_is_unreachable(monkeypatch):
    import huggingface_hub.constants as constants
    from ui_fixtures import free_port

    from ui.model import hub

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(hub.HubError, match="searching the Hub failed"):
        hub.search_models("anything")


def _dialog_on_the_tiny_repo(qtbot, tmp_path):
    """File ▸ Get model, having searched for "tiny" and picked the one repository found."""
    from ui.dialogs.get_model import GetModelDialog

    dialog = GetModelDialog(n_ctx=2048, folder=tmp_path / "models")
    qtbot.addWidget(dialog)
    dialog.query.setText("tiny")
    dialog.search()
    qtbot.waitUntil(lambda: dialog.repos.count() == 1, timeout=WAIT_MS)
    dialog.repos.setCurrentRow(0)
    return dialog


def test_get_model_dialog_gets_a_model_the_window_loads(qtbot, fake_hub, tiny_bytes,
                                                                           tmp_path, make_window):
    from app.gui import load_engine
    from ui.dialogs.get_model import GetModelDialog
    from ui.loader import ModelSpec

    dialog = _dialog_on_the_tiny_repo(qtbot, tmp_path)
    qtbot.waitUntil(lambda: dialog.table.rowCount() == 3 and dialog.shape is not None, timeout=WAIT_MS)
    names = [dialog.table.item(r, 0).text() for r in range(3)]
    assert names.count(SPLIT_DIR + "synthetic-tiny-f16 (3 parts)") == 1  # a model in parts: one row
    split_row = names.index(SPLIT_DIR + "synthetic-tiny-f16 (3 parts)")
    assert "00003-of-00003" in dialog.table.item(split_row, 0).toolTip()
    assert dialog.table.item(split_row, 3).text().startswith("RAM fits")
    assert dialog.table.item(0, 2).text().endswith("MiB") or dialog.table.item(0, 2).text().endswith("KiB")
    assert dialog.table.item(0, 3).text().startswith("RAM fits")
    assert "KV" in dialog.table.item(0, 3).toolTip()
    kv_2k = dialog.fit(dialog.files[0]).kv
    dialog.ctx.setValue(8192)
    assert dialog.fit(dialog.files[0]).kv == 4 * kv_2k
    dialog.table.selectRow(0)
    assert dialog.download_button.isEnabled()
    dialog.download()
    qtbot.waitUntil(lambda: dialog.downloaded is not None or not dialog.downloading, timeout=WAIT_MS)
    assert dialog.downloaded is not None, dialog.state_label.text()
    assert dialog.result() == GetModelDialog.Accepted
    assert dialog.downloaded.read_bytes() == tiny_bytes

    w = make_window(load_fn=load_engine)
    loaded = []
    w.engine_loaded.connect(loaded.append)
    w.load_model(ModelSpec(str(dialog.downloaded), ("cpu:threads=1,cap=2,ctx=512",)))
    qtbot.waitUntil(lambda: bool(loaded), timeout=WAIT_MS)
    assert os.path.samefile(w.engine.model.path, dialog.downloaded)


def test_get_model_dialog_resumes_from_the_bytes_a_stop_kept(qtbot, fake_hub, tiny_bytes, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    from ui.dialogs.get_model import GetModelDialog
    from ui.model import hub

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 << 10)
    dialog = _dialog_on_the_tiny_repo(qtbot, tmp_path)
    qtbot.waitUntil(lambda: dialog.table.rowCount() == 3, timeout=WAIT_MS)
    dialog.table.selectRow(0)
    f = dialog.selected_file()
    partial = hub.partial_path(f, tmp_path / "models" / "tester--Tiny-GGUF")
    fake_hub.stall_after = STOP_AT
    try:
        dialog.download()
        qtbot.waitUntil(lambda: partial.is_file() and partial.stat().st_size == STOP_AT, timeout=WAIT_MS)
        assert dialog.cancel_button.text() == "Stop download"
        dialog.cancel_button.click()
    finally:
        fake_hub.release.set()
    qtbot.waitUntil(lambda: not dialog.downloading, timeout=WAIT_MS)
    assert dialog.state_label.text() == f"Download stopped; {hub.fmt_bytes(STOP_AT)} kept: Download goes on from there."
    assert dialog.downloaded is None and dialog.result() != GetModelDialog.Accepted  # nothing to load yet

    dialog.download()
    assert dialog.state_label.text().startswith(f"Resuming {f.label}") and hub.fmt_bytes(STOP_AT) in \
        dialog.state_label.text()
    qtbot.waitUntil(lambda: dialog.downloaded is not None, timeout=WAIT_MS)
    assert dialog.downloaded.read_bytes() == tiny_bytes
    assert _served_after(fake_hub, f.path, STOP_AT) == len(tiny_bytes) - STOP_AT
