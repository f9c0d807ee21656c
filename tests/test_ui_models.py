"""Recent and local models: GGUF files found where other local-LLM apps keep them, listed under
their GGUF `general.name`, in the model dialog with the models loaded before."""

from __future__ import annotations

import json
import os

import gguf
from ui_fixtures import UI_MODEL, WAIT_MS, load_and_wait, make_window, qasync_loop, ui_engine  # noqa: F401

from app.gui import load_engine
from ui.dialogs.load_model import ModelDialog
from ui.model.local_models import model_folders, remember, scan


def write_gguf(path, name: str, arch: str = "llama") -> str:
    """A real GGUF file (header and metadata, no tensors) written by the gguf package."""
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_string("general.size_label", "135M")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gguf_files_are_listed_under_their_general_name(tmp_path):
    write_gguf(tmp_path / "models" / "smol" / "model.gguf", "SmolLM2 135M Instruct")
    (tmp_path / "models" / "notes.txt").write_text("not a model")
    found = scan(model_folders(env={}, home=tmp_path))
    assert [(m.name, m.source, m.size_label) for m in found] == [("SmolLM2 135M Instruct", "~/models", "135M")]
    assert "SmolLM2 135M Instruct" in found[0].title()


def test_a_model_in_parts_is_listed_once_as_its_first_part(tmp_path):
    from fake_hub import split_gguf

    from engine.llama.model import resolve_model

    folder = tmp_path / "models" / "tester--Tiny-GGUF"
    folder.mkdir(parents=True)
    parts = split_gguf(resolve_model("synthetic:tiny"), folder, 3)
    found = scan(model_folders(env={}, home=tmp_path))
    assert [m.path for m in found] == [str(parts[0])]  # what llama.cpp is given
    assert found[0].size == sum(p.stat().st_size for p in parts) and found[0].architecture


def test_hugging_face_cache_snapshots_are_found_once(tmp_path):
    hub = tmp_path / "hf" / "hub" / "models--org--smol"
    blob = write_gguf(hub / "blobs" / "0123abcd", "Smol From HF")
    link = hub / "snapshots" / "rev1" / "smol-q8_0.gguf"
    link.parent.mkdir(parents=True)
    os.symlink(blob, link)
    found = scan(model_folders(env={"HF_HOME": str(tmp_path / "hf")}, home=tmp_path))
    assert [(m.name, m.source, m.path) for m in found] == [("Smol From HF", "Hugging Face cache", str(link))]


def test_ollama_manifests_name_their_blobs(tmp_path):
    store = tmp_path / ".ollama" / "models"
    blob = write_gguf(store / "blobs" / "sha256-abc123", "Qwen2.5 0.5B Instruct", "qwen2")
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "qwen2.5" / "0.5b"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:zzz"},
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:abc123"}]}))
    found = scan(model_folders(env={}, home=tmp_path))
    assert [(m.alias, m.name, m.architecture, m.path) for m in found] == [
        ("qwen2.5:0.5b", "Qwen2.5 0.5B Instruct", "qwen2", blob)]


def test_a_file_that_is_not_gguf_is_listed_with_why(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "broken.gguf").write_bytes(b"hello world")
    found = scan(model_folders(env={}, home=tmp_path))
    assert [(m.name, m.error) for m in found] == [("broken", "not a GGUF file")]


def test_recent_models_keep_the_newest_first_without_repeats():
    recent = remember(["a", "b", "c"], "b")
    assert recent == ["b", "a", "c"]
    assert remember([str(i) for i in range(10)], "x")[:2] == ["x", "0"]
    assert len(remember([str(i) for i in range(10)], "x")) == 10


def test_model_dialog_lists_recent_models_first_then_local_ones_by_name(qtbot, tmp_path):
    path = write_gguf(tmp_path / "models" / "a.gguf", "Tiny Chat Model")
    folders = [("~/models", tmp_path / "models", "files")]
    dialog = ModelDialog(recent=["synthetic:tiny"], folders=folders)
    qtbot.addWidget(dialog)
    with qtbot.waitSignal(dialog.scanned, timeout=WAIT_MS):
        pass
    entries = dialog.entries()
    assert entries[0][1] == "synthetic:tiny"
    assert any("Tiny Chat Model" in text and spec == path for text, spec in entries)


def test_clicking_a_listed_model_chooses_it(qtbot, tmp_path):
    path = write_gguf(tmp_path / "models" / "a.gguf", "Tiny Chat Model")
    dialog = ModelDialog(folders=[("~/models", tmp_path / "models", "files")])
    qtbot.addWidget(dialog)
    qtbot.waitUntil(lambda: bool(dialog.entries()), timeout=WAIT_MS)
    row = next(i for i in range(dialog.models_list.count()) if dialog.models_list.item(i).text().strip().startswith("Tiny"))
    item = dialog.models_list.item(row)
    rect = dialog.models_list.visualItemRect(item)
    from PySide6.QtCore import Qt

    qtbot.mouseClick(dialog.models_list.viewport(), Qt.LeftButton, pos=rect.center())
    assert dialog.spec().model == path


def test_a_loaded_model_becomes_the_first_recent_one(qtbot, make_window):
    w = make_window(load_fn=load_engine)
    load_and_wait(qtbot, w)
    assert w.recent_models()[0] == UI_MODEL
    dialog = w.model_dialog(folders=[])
    qtbot.waitUntil(lambda: dialog.scan_label.text().startswith("No GGUF"), timeout=WAIT_MS)
    assert dialog.entries()[0][1] == UI_MODEL
    dialog.deleteLater()
