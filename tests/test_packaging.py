"""The project's front matter stays what the README promises: its two commands (the
second is CI's), a short README, numpy installed with the package, results named after
their tables, and documentation that reads as the project's, not as a work log."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)


def test_readme_is_short_and_its_second_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    first, second = _bash_blocks(readme)[0].strip().splitlines()[:2]
    assert "examples/quickstart.py" in first and "pip install" in first
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().strip().splitlines()]
    assert ci[-1] == second.strip()  # exactly the README's test command


def test_numpy_is_a_dependency() -> None:
    # torch imports numpy when it is installed and warns "Failed to initialize NumPy"
    # when it is not: the first command of the README must not print that
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(re.match(r"numpy\b", dep) for dep in project["dependencies"])
    assert project["classifiers"] and project["keywords"]


def test_results_are_named_after_tables() -> None:
    names = [p.name for p in (ROOT / "benchmarks" / "results").iterdir()]
    assert names
    bad = [n for n in names if re.search(r"session|run\d|rerun|previous|slices|_h200", n)]
    assert not bad


_WORK_LOG = re.compile(
    r"\bI\b(?!/O)|\bI'(m|ve|d)\b|\b[Ss]ession\b|(\b|_)run\d+\b|[Tt]his version\b"
    r"|\b[Rr]uns? \d+(-\d+)?\b(?![.\d])(?! (warm-up|steps?|times?|rounds?)\b)"
    r"|\bversions? ago\b|[Pp]revious version\b"
)


def _prose_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    files += sorted((ROOT / "docs").glob("*.md"))
    for folder in ("benchmarks", "examples"):
        files += sorted(
            p
            for p in (ROOT / folder).rglob("*")
            if p.suffix in {".py", ".md", ".sh"} and "results" not in p.parts
        )
    return files


def test_docs_benchmarks_and_examples_are_not_a_work_log() -> None:
    found = []
    for path in _prose_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _WORK_LOG.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
