"""File ▸ Get model: search the Hugging Face Hub for GGUF models, see what fits, download one.

The dialog drives `ui.hub` (Qt-free) on `ui.worker.Worker` threads: a search lists repositories
(most downloaded first); picking one lists its GGUF files with their size, quantisation and
whether each fits this machine's RAM / GPU memory at the context chosen in the dialog (the KV
cache priced from the repository's GGUF header, read by range from its smallest file); a model
in parts is one row (its total size). Download fetches the chosen model (every part) into the
models folder with a progress bar and the time left; Stop ends it and keeps what came, so the
next Download of that model (even after a restart) fetches only the rest. The sha256 is checked,
and the dialog is accepted with `downloaded` set (a model in parts: its first part): the window
then loads it.

Main thread only; each background call reports back through its worker's signals.
"""

from __future__ import annotations

import html
import threading
import time
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from . import hub
from .advice import advise
from .theme import FAILED, HEALTHY, WORKING, wrap_label
from .worker import Worker

VERDICT_COLOR = {"fits": HEALTHY, "tight": WORKING, "too big": FAILED}


class GetModelDialog(QDialog):
    """`n_ctx`: the context to price the KV cache at (editable); `folder`: where downloads go
    (`hub.models_folder()` by default); `vram_total`: the GPU memory a backend may use (0: none)."""

    def __init__(self, parent: QWidget | None = None, *, n_ctx: int = 4096, folder: Path | None = None,
                 vram_total: int = 0):
        super().__init__(parent)
        self.setWindowTitle("Get a model from the Hugging Face Hub")
        self.setMinimumSize(760, 520)
        self.folder = Path(folder) if folder is not None else hub.models_folder()
        self.memory = hub.machine_memory(vram_total)
        self.downloaded: Path | None = None
        self.files: list[hub.HubFile] = []
        self.shape: hub.Shape | None = None
        self._cancel = threading.Event()
        self._download_worker: Worker | None = None
        self._started = 0.0
        self._resumed_from = 0  # bytes already on disk when this download started
        self._build(n_ctx)

    def _build(self, n_ctx: int) -> None:
        self.query = QLineEdit()
        self.query.setPlaceholderText("Search GGUF models, e.g. SmolLM2, Qwen2.5 0.5B, Llama 3.2 1B")
        self.query.returnPressed.connect(self.search)
        self.search_button = QPushButton("Search")
        self.search_button.setObjectName("primary")
        self.search_button.clicked.connect(self.search)
        top = QHBoxLayout()
        top.addWidget(self.query, 1)
        top.addWidget(self.search_button)

        self.repos = QListWidget()
        self.repos.setMaximumWidth(300)
        self.repos.currentItemChanged.connect(lambda item, _old: self.list_files(item.text()) if item else None)
        self.table = QTableWidget(0, 4)
        self.table.setHorizontalHeaderLabels(["File", "Quant", "Size", "On this machine"])
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        h = self.table.horizontalHeader()
        h.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for col in (1, 2, 3):
            h.setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
        self.table.itemSelectionChanged.connect(self._update_buttons)
        middle = QHBoxLayout()
        middle.addWidget(self.repos)
        middle.addWidget(self.table, 1)

        self.ctx = QSpinBox(minimum=256, maximum=1 << 20, singleStep=1024, value=n_ctx)
        self.ctx.setSuffix(" tokens")
        self.ctx.setKeyboardTracking(False)
        self.ctx.valueChanged.connect(lambda _v: self._fill_table())
        mem = self.memory
        self.machine_label = QLabel(f"This machine: {hub.fmt_bytes(mem.ram_available)} RAM free of "
                                    f"{hub.fmt_bytes(mem.ram_total)}"
                                    + (f", GPU {hub.fmt_bytes(mem.vram_total)}" if mem.vram_total else ", no GPU"))
        self.machine_label.setObjectName("muted")
        fit_row = QHBoxLayout()
        fit_row.addWidget(QLabel("Context"))
        fit_row.addWidget(self.ctx)
        fit_row.addSpacing(12)
        fit_row.addWidget(self.machine_label, 1)

        self.state_label = wrap_label(QLabel("Type a name and press Search."))
        self.progress = QProgressBar()
        self.progress.setRange(0, 100)
        self.progress.setVisible(False)
        self.download_button = QPushButton("Download and load")
        self.download_button.setObjectName("primary")
        self.download_button.clicked.connect(self.download)
        self.cancel_button = QPushButton("Close")
        self.cancel_button.clicked.connect(self._cancel_or_close)
        bottom = QHBoxLayout()
        bottom.addWidget(self.progress, 1)
        bottom.addWidget(self.download_button)
        bottom.addWidget(self.cancel_button)

        folder = QLabel(f"Downloads go to {self.folder}")
        folder.setObjectName("muted")
        folder.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        lay = QVBoxLayout(self)
        lay.addLayout(top)
        lay.addLayout(middle, 1)
        lay.addLayout(fit_row)
        lay.addWidget(self.state_label)
        lay.addWidget(folder)
        lay.addLayout(bottom)
        self._update_buttons()

    # ---- search and listing ----

    def search(self) -> Worker:
        text = self.query.text()
        self.state_label.setText(f"Searching the Hub for “{text}”…")
        self.state_label.setToolTip("")
        self.search_button.setEnabled(False)
        worker = Worker(hub.search_models, text, name="hub-search", owner=self)
        worker.returned.connect(self._on_found)
        worker.errored.connect(self._on_error)
        worker.finished.connect(lambda: self.search_button.setEnabled(True))
        return worker.start()

    def _on_found(self, models: list) -> None:
        self.repos.clear()
        for m in models:
            item = QListWidgetItem(m.repo_id)
            item.setToolTip(f"{m.downloads:,} downloads · {m.likes:,} likes")
            self.repos.addItem(item)
        self.state_label.setText(f"{len(models)} repositories with GGUF files; pick one to see its files."
                                 if models else "No GGUF repository matches; try another name.")

    def list_files(self, repo_id: str) -> Worker:
        self.state_label.setText(f"Listing {repo_id}…")
        self.files, self.shape = [], None
        self._fill_table()

        def work():
            files = hub.gguf_files(repo_id)
            shape = hub.model_shape(files[0]) if files else None  # one architecture per repository
            return repo_id, files, shape

        worker = Worker(work, name="hub-files", owner=self)
        worker.returned.connect(self._on_files)
        worker.errored.connect(self._on_error)
        return worker.start()

    def _on_files(self, result) -> None:
        repo_id, files, shape = result
        current = self.repos.currentItem()
        if current is not None and current.text() != repo_id:
            return  # the user moved on to another repository
        self.files, self.shape = files, shape
        self._fill_table()
        if not files:
            self.state_label.setText(f"{repo_id} has no GGUF model.")
        else:
            kv = ("the KV cache priced from its GGUF header" if shape is not None
                  else "its GGUF header could not be read: weights only, without the KV cache")
            self.state_label.setText(f"{len(files)} GGUF files in {repo_id}; {kv}.")
        if files and not self.table.selectedItems():
            self.table.selectRow(self._best_row())

    def _best_row(self) -> int:
        """The largest file that fits the RAM (else the smallest)."""
        fitting = [i for i, f in enumerate(self.files) if self.fit(f).ram == "fits"]
        return fitting[-1] if fitting else 0

    def fit(self, f: hub.HubFile) -> hub.Fit:
        return hub.fits(f, self.shape, self.ctx.value(), self.memory)

    def _fill_table(self) -> None:
        self.table.setRowCount(len(self.files))
        for row, f in enumerate(self.files):
            fit = self.fit(f)
            cells = [f.label, f.quant or "?", hub.fmt_bytes(f.size),
                     f"RAM {fit.ram} · GPU {fit.vram}"]
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if col == 3:
                    item.setForeground(_brush(VERDICT_COLOR.get(fit.ram, WORKING)))
                    item.setToolTip(fit.text())
                elif col == 2:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                    item.setToolTip(f"{f.size:,} bytes" + (f"\nsha256 {f.sha256}" if f.sha256 else ""))
                elif col == 0 and f.parts:
                    item.setToolTip("Downloaded together; llama.cpp loads the first part and finds the others:\n"
                                    + "\n".join(f"{p.path}  {hub.fmt_bytes(p.size)}" for p in f.parts))
                self.table.setItem(row, col, item)
        self._update_buttons()

    def selected_file(self) -> hub.HubFile | None:
        rows = {i.row() for i in self.table.selectedItems()}
        return self.files[min(rows)] if rows and min(rows) < len(self.files) else None

    # ---- download ----

    @property
    def downloading(self) -> bool:
        return self._download_worker is not None and self._download_worker.running

    def download(self) -> Worker | None:
        f = self.selected_file()
        if f is None or self.downloading:
            return None
        self._cancel.clear()
        self._started = time.monotonic()
        self._resumed_from = hub.partial_bytes(f, self.folder)
        self.progress.setValue(int(self._resumed_from * 100 / f.size) if f.size else 0)
        self.progress.setVisible(True)
        what = f"{f.label} ({hub.fmt_bytes(f.size)})"
        self.state_label.setText(f"Resuming {what} from {hub.fmt_bytes(self._resumed_from)} on disk…"
                                 if self._resumed_from else f"Downloading {what}…")
        worker = Worker(lambda: hub.download(f, self.folder, lambda done, total: worker.report((done, total)),
                                             self._cancel),
                        name="hub-download", owner=self)
        worker.progress.connect(self._on_progress)
        worker.returned.connect(self._on_downloaded)
        worker.errored.connect(self._on_download_error)
        worker.finished.connect(self._update_buttons)
        self._download_worker = worker.start()
        self._update_buttons()
        return worker

    def _on_progress(self, value) -> None:
        done, total = value
        self.progress.setValue(int(done * 100 / total) if total else 0)
        spent = time.monotonic() - self._started
        text = f"{hub.fmt_bytes(done)} of {hub.fmt_bytes(total)}"
        fetched = done - self._resumed_from  # this time (the bytes on disk before say nothing of the link)
        if fetched > 0 and spent > 1:
            rate = fetched / spent
            text += f" · {hub.fmt_bytes(rate)}/s · about {max(0, (total - done) / rate):.0f} s left"
        self.progress.setFormat(text)

    def _on_downloaded(self, path) -> None:
        self.downloaded = Path(path)
        self.state_label.setText(f"Downloaded and checked (sha256): {self.downloaded.name}")
        self.accept()

    def _on_download_error(self, e: BaseException) -> None:
        self.progress.setVisible(False)
        if isinstance(e, hub.DownloadCancelled):
            f = self.selected_file()
            kept = hub.partial_bytes(f, self.folder) if f is not None else 0
            self.state_label.setText(f"Download stopped; {hub.fmt_bytes(kept)} kept: Download goes on from there."
                                     if kept else "Download stopped.")
        else:
            self._on_error(e)

    def _on_error(self, e: BaseException) -> None:
        advice = advise(e, "hub")  # "You seem to be offline: …"; the Hub client's words in the tooltip
        self.state_label.setText(f"<span style='color:{FAILED}'>{html.escape(advice.text)}</span>")
        self.state_label.setToolTip(advice.detail if advice.detail != advice.text else "")

    def _cancel_or_close(self) -> None:
        if self.downloading:
            self._cancel.set()
        else:
            self.reject()

    def _update_buttons(self) -> None:
        busy = self.downloading
        self.download_button.setEnabled(not busy and self.selected_file() is not None)
        self.cancel_button.setText("Stop download" if busy else "Close")
        self.search_button.setEnabled(not busy)

    def done(self, result: int) -> None:
        self._cancel.set()  # closing the dialog stops a download
        super().done(result)


def _brush(color: str):
    from PySide6.QtGui import QBrush, QColor

    return QBrush(QColor(color))
