"""The model picker: the embedded default, a GGUF file, or a synthetic model of a real shape.

Above the choices, a list of the models loaded recently and of the GGUF files found on this
machine (`ui.model.local_models`: the Hugging Face cache, LM Studio's and Ollama's folders, ~/models,
the app's data folder), each under its real name from the GGUF metadata. The folders are scanned
on a worker thread when the dialog opens; a click fills the choice below, a double-click loads.

Thread contract: main thread only (the scan reports through `ui.worker.Worker`).
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QRadioButton,
    QVBoxLayout,
    QWidget,
)

from engine.routing import DEFAULT, POLICIES

from ..loader import ModelSpec
from ..model.local_models import LocalModel, recent_entries, scan
from ..worker import Worker


def synthetic_shapes() -> list[str]:
    try:
        from engine.backends.config import synthetic_specs

        return synthetic_specs()
    except Exception:  # the picker still takes a typed name
        return ["tiny"]


class ModelDialog(QDialog):
    """`recent`: model specs loaded before, newest first. `folders`: where to look for GGUF files
    (`local_models.model_folders()` by default; an empty list looks nowhere)."""

    scanned = Signal(int)  # how many local models the scan found

    def __init__(self, current: ModelSpec | None = None, parent: QWidget | None = None, *,
                 recent: list[str] | None = None, folders=None):
        super().__init__(parent)
        self.setWindowTitle("Load a model")
        self.setMinimumWidth(560)
        current = current or ModelSpec()
        self.models_list = QListWidget()
        self.models_list.setMinimumHeight(120)
        self.models_list.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        self.models_list.itemClicked.connect(self._on_pick)
        self.models_list.itemDoubleClicked.connect(self._on_double_click)
        self.scan_label = QLabel("Looking for GGUF models on this machine…")
        self.scan_label.setObjectName("muted")
        self.recent = recent_entries(list(recent or []))
        self.local: list[LocalModel] = []
        self._fill_list()
        self._scan_worker = Worker(lambda: scan(folders), name="model-scan", owner=self)
        self._scan_worker.returned.connect(self._on_scanned)
        self._scan_worker.errored.connect(lambda e: self.scan_label.setText(f"Could not look for models: {e}"))
        self._scan_worker.start()
        self.default_radio = QRadioButton("Embedded default (SmolLM2-135M-Instruct)")
        self.file_radio = QRadioButton("GGUF file")
        self.synth_radio = QRadioButton("Synthetic: random weights with a real model's shape (for timing)")
        group = QButtonGroup(self)
        for r in (self.default_radio, self.file_radio, self.synth_radio):
            group.addButton(r)
        self.path_edit = QLineEdit()
        self.path_edit.setPlaceholderText("/path/to/model.gguf")
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        self.shape_combo = QComboBox()
        self.shape_combo.setEditable(True)
        self.shape_combo.addItems(synthetic_shapes())
        self.backends_edit = QLineEdit(" ".join(current.backends))
        self.backends_edit.setPlaceholderText("default: GPU + CPU, or two CPU backends splitting the cores")
        self.backends_edit.setToolTip("Space-separated backend specs, e.g. `gpu:cap=4 cpu:threads=8,cap=4,ctx=4096`")
        self.policy_combo = QComboBox()
        self.policy_combo.setEditable(True)
        self.policy_combo.addItems([DEFAULT, *POLICIES])
        self.policy_combo.setCurrentText(current.policy)

        if current.model == "default":
            self.default_radio.setChecked(True)
        elif current.model.startswith("synthetic:"):
            self.synth_radio.setChecked(True)
            self.shape_combo.setCurrentText(current.model.removeprefix("synthetic:"))
        else:
            self.file_radio.setChecked(True)
            self.path_edit.setText(current.model)

        file_row = QHBoxLayout()
        file_row.addWidget(self.path_edit, 1)
        file_row.addWidget(browse)
        form = QFormLayout()
        form.addRow(self.default_radio)
        form.addRow(self.file_radio)
        form.addRow("   Path", file_row)
        form.addRow(self.synth_radio)
        form.addRow("   Shape", self.shape_combo)
        form.addRow("Backends", self.backends_edit)
        form.addRow("Routing policy", self.policy_combo)
        note = QLabel("The current model keeps serving until the new one has loaded; if loading fails, nothing changes.")
        note.setObjectName("muted")
        note.setWordWrap(True)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Load")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        title = QLabel("Recent and local models")
        title.setObjectName("title")
        lay.addWidget(title)
        lay.addWidget(self.models_list, 1)
        lay.addWidget(self.scan_label)
        lay.addLayout(form)
        lay.addWidget(note)
        lay.addWidget(buttons)

    # ---- recent and local models ----

    def _fill_list(self) -> None:
        self.models_list.clear()
        for header, entries in (("Recent", self.recent), ("On this machine", self.local)):
            if not entries:
                continue
            head = QListWidgetItem(header)
            head.setFlags(Qt.ItemFlag.NoItemFlags)
            font = head.font()
            font.setBold(True)
            head.setFont(font)
            self.models_list.addItem(head)
            for m in entries:
                item = QListWidgetItem(("    " + m.title()) + (f"  — {m.source}" if header != "Recent" else ""))
                item.setData(Qt.ItemDataRole.UserRole, m.path)
                item.setToolTip(f"{m.path}\nGGUF general.name: {m.name}" if m.path != m.name else m.path)
                if m.error:
                    item.setFlags(item.flags() & ~Qt.ItemFlag.ItemIsEnabled)
                self.models_list.addItem(item)

    def _on_scanned(self, found: list[LocalModel]) -> None:
        self.local = found
        self._fill_list()
        n = sum(1 for m in found if not m.error)
        self.scan_label.setText(f"{n} GGUF model{'s' if n != 1 else ''} found on this machine" if found else
                                "No GGUF models found in the Hugging Face cache, LM Studio's or Ollama's folders, "
                                "~/models or Tandem's data folder.")
        self.scanned.emit(n)

    def entries(self) -> list[tuple[str, str]]:
        """(shown text, model spec) of every pickable row, in order."""
        out = []
        for i in range(self.models_list.count()):
            item = self.models_list.item(i)
            if item.data(Qt.ItemDataRole.UserRole):
                out.append((item.text().strip(), item.data(Qt.ItemDataRole.UserRole)))
        return out

    def pick(self, model: str) -> None:
        """Fill the choice below with `model` (a spec: `default`, `synthetic:…` or a path)."""
        if model == "default":
            self.default_radio.setChecked(True)
        elif model.startswith("synthetic:"):
            self.synth_radio.setChecked(True)
            self.shape_combo.setCurrentText(model.removeprefix("synthetic:"))
        else:
            self.file_radio.setChecked(True)
            self.path_edit.setText(model)

    def _on_pick(self, item: QListWidgetItem) -> None:
        if item.data(Qt.ItemDataRole.UserRole):
            self.pick(item.data(Qt.ItemDataRole.UserRole))

    def _on_double_click(self, item: QListWidgetItem) -> None:
        if item.data(Qt.ItemDataRole.UserRole) and item.flags() & Qt.ItemFlag.ItemIsEnabled:
            self.pick(item.data(Qt.ItemDataRole.UserRole))
            self.accept()

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF model", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.path_edit.setText(path)
            self.file_radio.setChecked(True)

    def spec(self) -> ModelSpec:
        if self.file_radio.isChecked():
            model = self.path_edit.text().strip()
        elif self.synth_radio.isChecked():
            model = "synthetic:" + self.shape_combo.currentText().strip()
        else:
            model = "default"
        return ModelSpec(model, tuple(self.backends_edit.text().split()), self.policy_combo.currentText().strip())
