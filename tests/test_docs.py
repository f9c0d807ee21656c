"""The docs describe the system as it is: a map, not a diary.

What is checked: `docs/NOTES.md` and `docs/performance.md` stay short; no doc heading carries a
date or a run; every repository path a doc names exists; a doc section that code or docs cite
by title exists; no module docstring names a date, a run or an issue; the study the code cites
is in the repository; the README opens with the two commands `.ci/run` runs; and the source
archive (`git archive HEAD`) stays small, measurement history being `export-ignore`d.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
DOC_FILES = sorted([*DOCS.glob("*.md"), *(DOCS / "design").glob("*.md")])
CODE_PACKAGES = ("engine", "app", "bench", "ui", "scripts")

NOTES_AND_PERFORMANCE_MAX_LINES = 900
ARCHIVE_MAX_BYTES = 6_000_000

DATE = re.compile(r"\b20\d\d-\d\d(?:-\d\d)?\b")
RUN = re.compile(
    r"\b(?:defaults|speed|round|fleet|chat|contexts|probe|llama|final|grid)\d+\b"
    r"|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|this|last|next|previous) session\b"
    r"|\bissue \d+\b",
    re.IGNORECASE,
)
BACKTICKED = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
BARE_PATH = re.compile(r"(?<![\w./-])(?:engine|app|bench|ui|tests|scripts|docs|resources)/[\w./*-]*[\w*/]")
SECTION_REF = re.compile(r"(docs/[\w./-]+\.md)[`\")\]]*,?\s*\(?\"([^\"]{1,120}?)\"")

PLACEHOLDERS = {"NAME", "DIR", "FOLDER", "LABEL", "PATH", "STEP", "FILE", "MODEL"}
# Words that look like our paths and are not: a QSettings key, another project's file.
NOT_OURS = {"ui/theme", "tests/v1/core/test_scheduler.py"}

# Docs other work writes, which this branch links before they land. Each entry goes once the
# file exists (`test_docs_written_elsewhere_are_still_missing` says when).
WRITTEN_ELSEWHERE: set[str] = set()


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _headings(text: str) -> Iterator[str]:
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            yield line


def _path_words(text: str) -> Iterator[str]:
    """Words that may be repository paths: in backticked spans, link targets, and any word that
    starts with one of the repository's top folders."""
    for span in BACKTICKED.findall(text):
        yield from span.split()
    yield from LINK.findall(text)
    yield from BARE_PATH.findall(text)


def _clean(word: str) -> str:
    word = word.lstrip("(['\"").rstrip(")]'\",;.:")
    word = word.split("#")[0].split("::")[0]
    return re.sub(r":[\d-]+$", "", word)


# Folders a setup step makes (the virtual environment, the GPU kit, wheels), git-ignored.
MADE_HERE = {".venv", ".gpukit", ".whl"}


def _is_candidate(word: str) -> bool:
    """A word with a slash, not a URL or an HTTP route (`/v1/...`), nor a template
    (`bench/NAME.py`, `FOLDER/chat-LABEL`)."""
    if "/" not in word or word.startswith("/") or any(c in word for c in ("://", "…", "...", "{", "<", "$", "=", "@", "|")):
        return False
    return not any(part.split(".")[0] in PLACEHOLDERS for part in word.split("/"))


def _resolves(word: str, doc_dir: Path) -> bool | None:
    """Whether `word` names an existing path; None when it does not look like one of ours.

    A path is read from the repository's root, from the doc's own folder, or from
    docs/results (where the result folders performance.md names live), whichever holds its
    first part."""
    first = word.split("/")[0]
    if first in MADE_HERE:
        return None  # made by a setup step on this machine, git-ignored: not in a fresh clone
    if first in (".", ".."):
        if ROOT not in (ROOT / word).resolve().parents:
            return None  # a command's path outside the repository (`../shared/...`)
        roots = [doc_dir]
    else:
        roots = [r for r in (ROOT, doc_dir, RESULTS) if (r / first).exists()]
    if not roots:
        return None
    target = word.rstrip("/")
    return any(roots[0].glob(target)) if "*" in target else (roots[0] / target).exists()


def missing_paths(doc: Path) -> list[str]:
    """The repository paths `doc` names (backticked or linked) that do not exist."""
    missing = []
    for raw in _path_words(doc.read_text()):
        word = _clean(raw)
        if not _is_candidate(word) or word in WRITTEN_ELSEWHERE:
            continue
        if _resolves(word, doc.parent) is False:
            missing.append(word)
    return sorted(set(missing))


def dated_headings(doc: Path) -> list[str]:
    return [h for h in _headings(doc.read_text()) if DATE.search(h) or RUN.search(h)]


def module_docstring_dates_and_runs(path: Path) -> list[str]:
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
    return [m.group() for pattern in (DATE, RUN) for m in pattern.finditer(doc)]


def _code_files() -> list[Path]:
    return sorted(p for pkg in CODE_PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _title(heading: str) -> str:
    return heading.lstrip("#").strip()


def unresolved_section_refs(text: str) -> list[str]:
    """`docs/X.md, "Title"` references whose doc has no heading starting with Title."""
    bad = []
    for doc, title in SECTION_REF.findall(text):
        title = " ".join(re.sub(r"\s#\s", " ", title).split()).rstrip(" .…")
        target = ROOT / doc
        if not target.exists():
            bad.append(f"{doc} (no such doc)")
        elif not any(_title(h).startswith(title) for h in _headings(target.read_text())):
            bad.append(f'{doc}, "{title}"')
    return bad


def test_the_notes_with_the_performance_page_stay_under_900_lines() -> None:
    lines = sum(len((DOCS / name).read_text().splitlines()) for name in ("NOTES.md", "performance.md"))
    assert lines < NOTES_AND_PERFORMANCE_MAX_LINES


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda d: _rel(d))
def test_no_doc_heading_carries_a_date_or_a_run(doc: Path) -> None:
    assert dated_headings(doc) == []


@pytest.mark.parametrize("doc", [*DOC_FILES, ROOT / "README.md"], ids=lambda d: _rel(d))
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    assert missing_paths(doc) == []


def test_docs_written_elsewhere_are_still_missing() -> None:
    """Once a doc in WRITTEN_ELSEWHERE lands, the path check covers it: drop it from the set."""
    assert [p for p in sorted(WRITTEN_ELSEWHERE) if (ROOT / p).exists()] == []


@pytest.mark.parametrize("doc", [*DOC_FILES, ROOT / "README.md"], ids=lambda d: _rel(d))
def test_every_doc_section_a_doc_cites_exists(doc: Path) -> None:
    assert unresolved_section_refs(doc.read_text()) == []


def test_every_doc_section_the_code_cites_exists() -> None:
    bad = {_rel(p): refs for p in _code_files() if (refs := unresolved_section_refs(p.read_text()))}
    assert bad == {}


def test_every_path_the_code_names_exists() -> None:
    """Paths that comments and docstrings of the code and scripts name (`engine/...`, `docs/...`)."""
    tests = [p for p in sorted((ROOT / "tests").glob("*.py")) if p.name != Path(__file__).name]
    files = [*_code_files(), *sorted((ROOT / "scripts").rglob("*.sh")), *tests]
    bad = {}
    for p in files:
        words = {w for raw in BARE_PATH.findall(p.read_text()) if _is_candidate(w := _clean(raw))} - NOT_OURS
        if missing := sorted(w for w in words if _resolves(w, ROOT) is False):
            bad[_rel(p)] = missing
    assert bad == {}


def test_no_module_docstring_names_a_date_a_run_or_an_issue() -> None:
    found = {_rel(p): hits for p in _code_files() if (hits := module_docstring_dates_and_runs(p))}
    assert found == {}


def test_the_study_the_code_cites_is_in_the_repository() -> None:
    old_name = "SEED" + ".md"  # spelt apart so that this file does not cite it
    citing = [_rel(p) for p in [*_code_files(), *sorted((ROOT / "tests").glob("*.py"))] if old_name in p.read_text()]
    assert (DOCS / "study.md").exists()
    assert citing == []


def test_the_readme_opens_with_the_two_commands_ci_runs() -> None:
    block = ROOT.joinpath("README.md").read_text().split("```")[1]
    commands = [line for line in block.splitlines()[1:] if line.strip()]
    assert len(commands) == 2
    assert commands[1] in ROOT.joinpath(".ci", "run").read_text()


@pytest.mark.skipif(not (ROOT / ".git").exists() or shutil.which("git") is None,
                    reason="not a git checkout: there is no HEAD to archive")
def test_the_source_archive_stays_under_6_mb() -> None:
    out = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    assert len(out) < ARCHIVE_MAX_BYTES
