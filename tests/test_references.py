"""Every pointer into the documentation resolves: Markdown links to a file of the
repository (and to a heading of it, by GitHub's anchor rules), and the references that
docstrings and comments make in prose: ``docs/x.md#anchor``, ``docs/x.md, "Heading"``
(or ``README, "Heading"``) and ``docs/design.md 4.9`` (a numbered section)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
#: docs/x.md#anchor, README.md#anchor, x.md#anchor (in prose, code or comments)
_ANCHORED = re.compile(r"(?<![\w/.-])((?:docs/)?[\w-]+\.md)#([\w-]+)")
#: docs/x.md, "Heading" / README, "Heading" (a comma or "section" before the quote)
_TITLED = re.compile(r"(?<![\w/.-])((?:docs/)?[\w-]+\.md|README)(?:,|,? section)\s+\"([^\"]+)\"")
#: docs/design.md 4.9 / docs/design.md section 3
_NUMBERED = re.compile(r"(?<![\w/.-])(docs/[\w-]+\.md),?\s+(?:section\s+)?(\d+(?:\.\d+)*)\b")


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_``
    dropped, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def headings(path: Path) -> list[str]:
    """The headings of a Markdown file, outside code blocks."""
    found, fenced = [], False
    for line in path.read_text().splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced and (m := _HEADING.match(line)):
            found.append(m.group(2))
    return found


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes for ``path``'s headings (repeats get ``-1``, ``-2``)."""
    seen: dict[str, int] = {}
    out = set()
    for title in headings(path):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("offload", "examples"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def _target(source: Path, name: str) -> Path:
    """``name`` as written in ``source``: a link relative to a Markdown file's folder,
    a prose path relative to the repository (``README`` is README.md; a bare ``x.md``
    in docs/ or in docs' own words is docs/x.md)."""
    if name == "README":
        return ROOT / "README.md"
    for base in (source.parent, ROOT, ROOT / "docs"):
        if (base / name).exists():
            return base / name
    return ROOT / name


def references(path: Path) -> list[tuple[int, str, str, str]]:
    """``(line, kind, file, what)`` for every reference of ``path``."""
    text = path.read_text()
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if path.suffix == ".md":
            for m in _LINK.finditer(line):
                target = m.group(1)
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue  # a URL, or an anchor of the page itself (checked below)
                name, _, anchor = target.partition("#")
                out.append((i, "anchor" if anchor else "file", name, anchor))
            for m in re.finditer(r"\]\(#([\w-]+)\)", line):
                out.append((i, "anchor", str(path.relative_to(ROOT)), m.group(1)))
        for m in _ANCHORED.finditer(line):
            out.append((i, "anchor", m.group(1), m.group(2)))
        for m in _TITLED.finditer(line):
            out.append((i, "title", m.group(1), m.group(2)))
        for m in _NUMBERED.finditer(line):
            out.append((i, "number", m.group(1), m.group(2)))
    return sorted(set(out))  # a Markdown link is also a prose reference


def test_the_slug_follows_githubs_rules() -> None:
    assert slug("Other offloaders and the compiler's budget") == (
        "other-offloaders-and-the-compilers-budget"
    )
    assert slug("`torch.compile` of a model") == "torchcompile-of-a-model"
    assert slug("4.4 Double buffering") == "44-double-buffering"


def test_every_reference_resolves() -> None:
    bad = []
    checked = 0
    for path in _files():
        for line, kind, name, what in references(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            target = _target(path, name)
            checked += 1
            if not target.exists():
                bad.append(f"{where}: {name} does not exist")
            elif kind == "anchor" and what not in anchors(target):
                bad.append(f"{where}: {name} has no heading for #{what}")
            elif kind == "title" and what.lower() not in {
                re.sub(r"^[\d.]+\s+", "", h).lower() for h in headings(target)
            }:
                bad.append(f'{where}: {name} has no heading "{what}"')
            elif kind == "number" and not any(
                re.match(rf"{re.escape(what)}\b", h) for h in headings(target)
            ):
                bad.append(f"{where}: {name} has no section {what}")
    assert checked > 50, checked  # the patterns still find the references
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "line",
    [
        'caching allocator (README, "Double buffering", has it)',
        "see docs/performance.md#no-such-heading",
        "[text](docs/nowhere.md)",
    ],
)
def test_a_stale_reference_is_found(tmp_path: Path, line: str) -> None:
    page = tmp_path / "page.md"
    page.write_text(line + "\n")
    found = references(page)
    assert found, line
    _, kind, name, what = found[0]
    target = _target(page, name)
    stale = not target.exists() or (
        (kind == "anchor" and what not in anchors(target))
        or (kind == "title" and what not in {h.lower() for h in headings(target)})
    )
    assert stale, found


def test_readme_docs_and_examples_import_public_names_only() -> None:
    """What a reader copies names public modules only (``offload.models``, not the
    private module it used to be)."""
    import offload.models

    assert offload.models.ReferenceModel.__module__ == "offload.models"
    private = re.compile(r"\b(?:from|import)\s+offload(?:\.\w+)*\._\w+|\boffload\._\w+")
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.py")]
    internal = {"design.md", "decisions.md"}  # the maintainers' pages name modules
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in pages
        if p.name not in internal
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert not found, "\n".join(found)
    anywhere = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    for folder in ("offload", "examples", "benchmarks", "tests"):
        anywhere += (ROOT / folder).rglob("*.py")
    stale = [
        str(p.relative_to(ROOT))
        for p in anywhere
        if p.name != "bench_versions.py"  # reads older trees, which have the old module
        and p != Path(__file__)
        and re.search(r"offload[./]_reference\b", p.read_text())
    ]
    assert not stale, stale


def test_cli_offload_layers_default_is_the_librarys() -> None:
    import inspect

    import offload
    from offload.cli import _offload_layers

    default = inspect.signature(offload.ActivationOffloader).parameters["offload_layers"]
    assert _offload_layers(None, 8) == default.default == "auto"
