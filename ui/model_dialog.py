"""The model picker: the embedded default, a GGUF file, or a synthetic model of a real shape."""

from __future__ import annotations

from PySide6.QtWidgets import (
    QButtonGroup, QComboBox, QDialog, QDialogButtonBox, QFileDialog, QFormLayout, QHBoxLayout,
    QLabel, QLineEdit, QPushButton, QRadioButton, QVBoxLayout, QWidget,
)

from engine.router import POLICIES

from .loader import ModelSpec



def synthetic_shapes() -> list[str]:
    try:
        from engine.config import synthetic_specs

        return synthetic_specs()
    except Exception:  # noqa: BLE001  (the picker still takes a typed name)
        return ["tiny"]


class ModelDialog(QDialog):
    def __init__(self, current: ModelSpec | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Load a model")
        self.setMinimumWidth(560)
        current = current or ModelSpec()
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
        self.policy_combo.addItems(list(POLICIES))
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
        buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Cancel)
        buttons.button(QDialogButtonBox.Ok).setText("Load")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(note)
        lay.addWidget(buttons)

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
