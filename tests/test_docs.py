"""The code in the documentation runs as written.

* README.md: its first Python snippet (the first example a reader tries), on the CPU and,
  on a CUDA machine, on the GPU; and every call of its "What to use" table, each on a
  small model made for it (a call whose arguments are elided, ``f(...)``, and a bare
  name: the name resolves).
* docs/*.md: every ```python block of a page, in order, in one namespace per page (a
  page's later blocks use what its first ones made). A block preceded by the line
  ``<!-- gpu-only -->`` runs only in the GPU variant of the test.

Each page runs from a temporary directory of its own (files a block writes land there),
with the repository root on ``PYTHONPATH``: on the CPU every page in one subprocess
(each page in a fresh namespace, one after the other: the interpreter and torch start
once), which hides the GPUs (``CUDA_VISIBLE_DEVICES=""``); on the GPU one subprocess per
page.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GPU_ONLY = "<!-- gpu-only -->"
TIMEOUT = 300  # seconds per page
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)

# Runs the blocks of one page in one namespace; names the block that failed.
_RUNNER = """
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for block in blocks:
    try:
        exec(compile(block["code"], f"{block['page']}:{block['line']}", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: the block of {block['page']} at line {block['line']}", file=sys.stderr)
        sys.exit(1)
print(f"ran {len(blocks)} block(s)")
"""


def python_blocks(path: Path) -> list[dict]:
    """The ```python blocks of a Markdown file: code, line of the fence, GPU-only mark."""
    text = path.read_text()
    blocks = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = [ln.strip() for ln in text[: match.start()].splitlines() if ln.strip()]
        blocks.append(
            {
                "code": match.group(1),
                "line": line,
                "page": str(path.relative_to(ROOT)),
                "gpu_only": bool(before) and before[-1] == GPU_ONLY,
            }
        )
    return blocks


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.glob("*.md") if python_blocks(p))


def _missing_packages(block: dict) -> list[str]:
    """Optional packages (the ``dev`` and ``plot`` extras) a block imports or needs and
    this environment lacks."""
    code = block["code"]
    wanted = {"transformers", "accelerate", "matplotlib"}
    used = {name for name in wanted if re.search(rf"^\s*(from|import) {name}\b", code, re.M)}
    if "transformers.Trainer" in code:
        used.add("accelerate")
    if ".plot(" in code:
        used.add("matplotlib")
    return sorted(name for name in used if importlib.util.find_spec(name) is None)


def _env(cuda: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "2")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_blocks(blocks: list[dict], tmp_path: Path, *, cuda: bool) -> str:
    """Run ``blocks`` in one subprocess; fail with its output unless it exits with 0.

    Blocks that need an optional package this environment lacks are left out (they come
    last on their pages); when that leaves none, the test is skipped."""
    runnable = [b for b in blocks if not _missing_packages(b)]
    if not runnable:
        missing = sorted({name for b in blocks for name in _missing_packages(b)})
        pytest.skip(f"needs {', '.join(missing)}")
    blocks = runnable
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(blocks))
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(spec)],
        cwd=tmp_path,
        env=_env(cuda),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, (
        f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )
    return proc.stdout


# ---- README.md ------------------------------------------------------------------------


def _readme_first_block() -> dict:
    blocks = python_blocks(ROOT / "README.md")
    assert blocks, "README.md has no ```python block"
    return blocks[0]


def test_readme_first_snippet_runs_on_cpu(tmp_path: Path) -> None:
    block = _readme_first_block()
    assert not block["gpu_only"], "the README's first example must run on a CPU"
    out = run_blocks([block], tmp_path, cuda=False)
    assert re.search(r"offloaded [1-9][\d.]* MiB", out), out  # it printed a saving


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_readme_first_snippet_runs_on_gpu(tmp_path: Path) -> None:
    out = run_blocks([_readme_first_block()], tmp_path, cuda=True)
    assert re.search(r"offloaded [1-9][\d.]* MiB", out), out


def readme_table_calls() -> list[str]:
    """The code of the "use" column of the README's "What to use" table: every span
    in backticks that is Python naming ``offload`` or a call (keywords such as
    ``compress="fp8"`` and commands such as ``offload profile`` are not calls)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## What to use", 1)[1].split("\n## ", 1)[0]
    spans = []
    for row in section.splitlines():
        cells = row.split("|")
        if len(cells) < 4 or set(cells[2].strip()) <= set("-"):
            continue
        for span in re.findall(r"`([^`]+)`", cells[2]):
            try:
                tree = ast.parse(span)
            except SyntaxError:
                continue  # `with offloader:`, a shell command
            calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
            if calls or span.startswith("offload."):
                spans.append(span)
    return spans


# Runs each call of the README table on a small model of its own (argv[1]: the calls as
# JSON); a planner call without CUDA must stop at the documented refusal.
_TABLE_RUNNER = """
import ast, contextlib, json, sys, traceback
import torch
import offload
from offload.models import ReferenceModel


def fresh(code):
    torch.manual_seed(0)
    ns = {"torch": torch, "offload": offload}
    if any(name in code for name in HF_CALLS):
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        )
        ns["model"] = transformers.LlamaForCausalLM(config).train()
        return ns
    model = ReferenceModel(layers=3, hidden=64, heads=2, ffn=128)
    layers = offload.find_layers(model)
    x = torch.randn(2, 16, 64)
    offloader = offload.ActivationOffloader(layers, min_tensor_bytes=0)

    def step():  # profile_step's step enters the offloader; plan's does not
        with offloader if "profile_step" in code else contextlib.nullcontext():
            loss = model.loss(x)
        loss.backward()

    ns.update(model=model, layers=layers, layer=layers[0], fn=layers[0], step=step,
              offloader=offloader, x=x.requires_grad_(True))
    return ns


HF_CALLS = (".hf.", "sliced_head_loss", "tile_mlp")  # calls on a Hugging Face causal LM
ran = 0
for code in json.load(open(sys.argv[1])):
    nodes = list(ast.walk(ast.parse(code)))
    elided = any(isinstance(n, ast.Constant) and n.value is Ellipsis for n in nodes)
    try:
        ns = fresh(code)
        if elided or not any(isinstance(n, ast.Call) for n in nodes):
            name = code.split("(")[0]
            assert eval(name, ns) is not None, name  # the name resolves
            continue
        try:
            exec(code, ns)
        except RuntimeError as e:
            refusal = code.startswith("offload.plan(") and "needs a CUDA device" in str(e)
            if not refusal or torch.cuda.is_available():
                raise
        ran += 1
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: the README table's call {code!r}", file=sys.stderr)
        sys.exit(1)
print(f"ran {ran} call(s)")
"""


def test_readme_table_calls_run_as_written(tmp_path: Path) -> None:
    calls = readme_table_calls()
    # the table names the planner as DESIGN does: offload.plan(step_fn, layers, *, budget)
    assert "offload.plan(step, layers, budget=0.5)" in calls, calls
    assert len(calls) >= 12, calls
    if importlib.util.find_spec("transformers") is None:
        calls = [
            c for c in calls if not any(n in c for n in (".hf.", "sliced_head_loss", "tile_mlp"))
        ]
    spec = tmp_path / "calls.json"
    spec.write_text(json.dumps(calls))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "2")
    proc = subprocess.run(
        [sys.executable, "-c", _TABLE_RUNNER, str(spec)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-6000:]}"
    assert "ran " in proc.stdout


# ---- docs/ ----------------------------------------------------------------------------


def test_docs_have_python_blocks_and_marks_only_before_them() -> None:
    pages = _pages()
    assert len(pages) >= 8, [p.name for p in pages]
    for page in DOCS.glob("*.md"):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == GPU_ONLY:
                following = next((ln for ln in lines[i + 1 :] if ln.strip()), "")
                assert following.startswith("```python"), (
                    f"{page.name}:{i + 1}: mark not before a block"
                )


# Runs the pages of argv[1] ({page: blocks}), each in a fresh namespace and a folder of
# its own, in one process; writes {page: {"ok", "output"}} to argv[2].
_PAGES_RUNNER = """
import contextlib, io, json, os, sys, traceback
pages = json.load(open(sys.argv[1]))
results = {}
root = os.getcwd()
for page, blocks in pages.items():
    folder = os.path.join(root, page.replace("/", "_"))
    os.makedirs(folder)
    os.chdir(folder)
    out = io.StringIO()
    namespace = {"__name__": "__main__"}
    ok = True
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        for block in blocks:
            try:
                exec(compile(block["code"], f"{page}:{block['line']}", "exec"), namespace)
            except BaseException:
                traceback.print_exc()
                print(f"FAILED: the block of {page} at line {block['line']}")
                ok = False
                break
    os.chdir(root)
    results[page] = {"ok": ok, "output": out.getvalue()}
json.dump(results, open(sys.argv[2], "w"))
"""


def _cpu_blocks(page: Path) -> list[dict]:
    """The blocks of ``page`` the CPU test runs: not GPU-only, packages installed."""
    blocks = [b for b in python_blocks(page) if not b["gpu_only"]]
    return [b for b in blocks if not _missing_packages(b)]


@pytest.fixture(scope="module")
def cpu_pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every page's CPU blocks run in one subprocess (torch imported once, not once per
    page): per page, whether its blocks ran and what they printed."""
    pages = {str(p.relative_to(ROOT)): _cpu_blocks(p) for p in _pages()}
    pages = {name: blocks for name, blocks in pages.items() if blocks}
    tmp = tmp_path_factory.mktemp("docs_cpu")
    spec, result = tmp / "pages.json", tmp / "results.json"
    spec.write_text(json.dumps(pages))
    proc = subprocess.run(
        [sys.executable, "-c", _PAGES_RUNNER, str(spec), str(result)],
        cwd=tmp,
        env=_env(False),
        capture_output=True,
        text=True,
        timeout=TIMEOUT * 3,
    )
    assert proc.returncode == 0 and result.exists(), (
        f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )
    return json.loads(result.read_text())


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_docs_blocks_run_on_cpu(page: Path, cpu_pages: dict[str, dict]) -> None:
    blocks = [b for b in python_blocks(page) if not b["gpu_only"]]
    if not blocks:
        pytest.skip(f"{page.name}: every block is GPU-only")
    if not _cpu_blocks(page):
        missing = sorted({name for b in blocks for name in _missing_packages(b)})
        pytest.skip(f"needs {', '.join(missing)}")
    got = cpu_pages[str(page.relative_to(ROOT))]
    assert got["ok"], got["output"][-6000:]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_docs_blocks_run_on_gpu(page: Path, tmp_path: Path) -> None:
    run_blocks(python_blocks(page), tmp_path, cuda=True)
