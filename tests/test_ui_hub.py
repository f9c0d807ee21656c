"""Get model: searching, listing, pricing and downloading GGUF models through `huggingface_hub`,
against a local server that speaks the Hub's API (`tests/fake_hub.py`; `HF_ENDPOINT` points at
it: the tests have no internet). The file served is a real GGUF (the tiny synthetic model), so
the header read by range and the model loaded after the download are real too."""

from __future__ import annotations

import os
import threading

import pytest
from fake_hub import FakeHub
from ui_fixtures import WAIT_MS, make_window, qasync_loop, ui_engine  # noqa: F401

from engine.llama.model import resolve_model

REPO = "tester/Tiny-GGUF"


@pytest.fixture(scope="module")
def tiny_bytes():
    return resolve_model("synthetic:tiny").read_bytes()


@pytest.fixture
def fake_hub(tiny_bytes, monkeypatch, tmp_path):
    hub_server = FakeHub()
    hub_server.add(REPO, {"tiny-Q8_0.gguf": tiny_bytes, "sub/tiny-F16.gguf": tiny_bytes + b"\0" * 4096,
                          "mmproj-tiny-f16.gguf": tiny_bytes[:4096],
                          "big-00001-of-00002.gguf": tiny_bytes[:1024], "README.md": b"# tiny"},
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
    from ui import hub

    found = hub.search_models("gguf")
    assert [m.repo_id for m in found] == ["tester/Other-GGUF", REPO]
    assert found[0].downloads == 99
    assert any(path == "/api/models" for _m, path, _r in fake_hub.requests)


def test_listing_keeps_single_file_models_with_their_size_sha256_quant(fake_hub, tiny_bytes):
    from ui import hub

    files = hub.gguf_files(REPO)
    assert [f.path for f in files] == ["tiny-Q8_0.gguf", "sub/tiny-F16.gguf"]  # smallest first
    assert files[0].size == len(tiny_bytes) and files[0].sha256 == FakeHub.sha256(tiny_bytes)
    assert [f.quant for f in files] == ["Q8_0", "F16"]
    with pytest.raises(hub.HubError, match="listing tester/missing failed"):
        hub.gguf_files("tester/missing")


def test_the_shape_comes_from_the_header_read_by_range(fake_hub, tiny_bytes):
    from gguf import GGUFReader

    from ui import hub

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

    from ui import hub

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
    from ui import hub

    f = hub.gguf_files(REPO)[0]
    fake_hub.corrupt.add(f.path)
    with pytest.raises(hub.HubError, match="sha256"):
        hub.download(f, tmp_path)
    assert not (tmp_path / "tester--Tiny-GGUF" / f.path).exists()


def test_a_cancelled_download_stops(fake_hub, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    from ui import hub

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 << 10)  # several chunks: stop after the first

    f = hub.gguf_files(REPO)[0]
    cancel = threading.Event()

    def progress(done, total):
        if done:
            cancel.set()  # stop at the first bytes

    with pytest.raises(hub.DownloadCancelled):
        hub.download(f, tmp_path, progress=progress, cancel=cancel)
    assert not (tmp_path / "tester--Tiny-GGUF" / f.path).exists()


def test_the_search_fails_with_a_message_when_the_hub_is_unreachable(monkeypatch):
    import huggingface_hub.constants as constants

    from ui import hub
    from ui_fixtures import free_port

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(hub.HubError, match="searching the Hub failed"):
        hub.search_models("anything")


def test_get_model_dialog_gets_a_model_the_window_loads(qtbot, fake_hub, tiny_bytes,
                                                                           tmp_path, make_window):
    from app.gui import load_engine
    from ui.get_model import GetModelDialog
    from ui.loader import ModelSpec

    dialog = GetModelDialog(n_ctx=2048, folder=tmp_path / "models")
    qtbot.addWidget(dialog)
    dialog.query.setText("tiny")
    dialog.search()
    qtbot.waitUntil(lambda: dialog.repos.count() == 1, timeout=WAIT_MS)
    dialog.repos.setCurrentRow(0)
    qtbot.waitUntil(lambda: dialog.table.rowCount() == 2 and dialog.shape is not None, timeout=WAIT_MS)
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
