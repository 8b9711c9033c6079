"""The ``offload`` command line on the CPU: messages that name the cause and a way out
that works, the version, and help text wrapped on word boundaries."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offload
from offload import cli
from offload._planner.levers import LEVERS

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--layers", "2", "--seq", "8", "--steps", "1", "--warmup", "0"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the advice of a machine without CUDA")
def test_plan_without_cuda_advises_what_runs_here(capsys) -> None:
    """No CUDA: the message says the planner needs one and points at what runs here,
    never at ``--device cpu`` (which the planner refuses)."""
    for extra in ([], ["--device", "cpu"], ["--device", "cuda"]):
        assert cli.main(["plan", "--budget", "0.5", *extra]) == 2
        err = capsys.readouterr().err
        assert "needs a CUDA device" in err and "offload profile" in err, err
        assert "--device cpu" not in err, err


def test_hidden_alone_gets_heads_that_divide_it(capsys) -> None:
    """``--hidden 100`` without ``--heads``: the default head count divides the width
    (never an error naming a flag the user did not pass); ``--heads`` given and not
    dividing is that flag's error."""
    assert cli.main(["profile", "--hidden", "100", *TINY]) == 0
    out = capsys.readouterr().out
    assert "hidden 100, 2 heads" in out, out
    assert cli._default_heads(4096) == 32 and cli._default_heads(128) == 4
    assert all(h % cli._default_heads(h) == 0 for h in range(1, 3000))
    assert cli.main(["profile", "--hidden", "100", "--heads", "3", *TINY]) == 2
    assert "--heads=3: must divide --hidden=100" in capsys.readouterr().err


def test_compress_on_a_float32_model_is_refused(capsys, tmp_path) -> None:
    """``--compress fp8`` compresses bf16/fp16 tensors only: on the float32 CPU default
    it would compress nothing, so it is refused with the flag that makes it work; with
    ``--dtype bf16`` bytes are compressed."""
    for command in (["profile", *TINY], ["plan", "--budget", "0.5", "--device", "cuda"]):
        if command[0] == "plan" and not torch.cuda.is_available():
            continue  # the CUDA check comes first there
        assert cli.main([*command, "--compress", "fp8", "--dtype", "float32"]) == 2
        err = capsys.readouterr().err
        assert "--compress fp8" in err and "float32" in err and "--dtype bf16" in err, err
    assert cli.main(["profile", *TINY, "--compress", "fp8"]) == 2  # the CPU default dtype
    capsys.readouterr()
    out = tmp_path / "p.json"
    assert (
        cli.main(["profile", *TINY, "--compress", "fp8", "--dtype", "bf16", "--json", str(out)])
        == 0
    )
    stats = json.loads(out.read_text())["stats"]
    assert 0 < stats["compress_bytes_after"] < stats["compress_bytes_before"]


def test_unknown_model_type_is_one_line(capsys, tmp_path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    assert cli.main(["profile", "--device", "cpu", "--hf-config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "model_type 'no_such_model' is not known to transformers" in err


def test_version_in_one_place(capsys) -> None:
    """``offload --version`` and ``python -m offload --version`` print the package's
    ``__version__``, which pyproject.toml reads (it states no version of its own)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"offload {offload.__version__}"
    got = subprocess.run(
        [sys.executable, "-m", "offload", "--version"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        check=True,
    )
    assert got.stdout.strip() == f"offload {offload.__version__}"
    script = shutil.which("offload")
    if script is not None:
        got = subprocess.run([script, "--version"], capture_output=True, text=True, env=_env())
        assert got.stdout.strip() == f"offload {offload.__version__}"
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "offload.__version__"
    assert re.fullmatch(r"\d+\.\d+\.\d+", offload.__version__)


@pytest.mark.parametrize("command", [[], ["profile"], ["plan"]])
def test_help_wraps_on_word_boundaries(command) -> None:
    """At 80 columns no word of the help is cut in two (argparse's default breaks long
    words: ``off load``, ``checkpoint _offload``)."""
    got = subprocess.run(
        [sys.executable, "-m", "offload", *command, "--help"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        check=True,
    )
    words = set(got.stdout.split())
    assert "off" not in words and "_offload" not in words, got.stdout
    if command == ["plan"]:
        for lever in LEVERS:
            assert lever in words or f"{lever}," in words or f"{lever};" in words, lever
    if command:  # every word of every flag's help is there whole
        parser = cli.build_parser()
        sub = next(a for a in parser._actions if a.dest == "command")
        for action in sub.choices[command[0]]._actions:
            for word in (action.help or "").split():
                assert word in words, (action.dest, word)
