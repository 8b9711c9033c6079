"""The ``offload`` command line: ``offload profile`` and ``offload plan`` (also
``python -m offload profile|plan``).

``offload profile`` builds a model with random weights (the built-in Llama-style
reference stack, or any Hugging Face causal LM from a ``config.json``), runs
:func:`offload.profile_step` on it and prints the report; ``--json`` and ``--plot`` save
the profile and its timeline. ``offload plan --budget 0.5`` measures the same kind of
model (CUDA) and prints the lever per layer (:func:`offload.plan`) that meets the budget;
``--measure`` applies the plan and measures it.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from offload._planner.levers import DEFAULT_LEVERS, LEVERS
from offload._planner.model_levers import MODEL_LEVERS

__all__ = ["main", "build_parser"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

#: Defaults by device type: tiny on the CPU, "ref-8L" (8 Llama layers of 4096) on CUDA.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"layers": 2, "hidden": 128, "seq": 64, "batch": 1, "dtype": "float32"},
    "cuda": {"layers": 8, "hidden": 4096, "seq": 4096, "batch": 1, "dtype": "bfloat16"},
}
_PROGRESS_AFTER_S = 2.0


class CliError(Exception):
    """A bad flag: the message names it and what it accepts."""


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help, wrapped on spaces only: a long word (a path, a comma list) is
    never broken inside, and neither is a hyphenated one."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = " ".join(text.split())
        return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = " ".join(text.split())
        return textwrap.fill(
            text,
            width,
            initial_indent=indent,
            subsequent_indent=indent,
            break_long_words=False,
            break_on_hyphens=False,
        )


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model")
    model.add_argument(
        "--hf-config",
        metavar="PATH",
        help=(
            "a Hugging Face config.json (or its folder): AutoModelForCausalLM.from_config, "
            "random weights, layers found with offload.find_layers; needs transformers"
        ),
    )
    model.add_argument(
        "--layers",
        type=int,
        help=(
            "number of layers (with --hf-config: overrides num_hidden_layers); default 2 on "
            "CPU, 8 on CUDA"
        ),
    )
    model.add_argument("--hidden", type=int, help="model width; default 128 on CPU, 4096 on CUDA")
    model.add_argument(
        "--heads",
        type=int,
        help=(
            "attention heads; default hidden/128 (hidden/32 for widths below 1024), "
            "lowered to the nearest count that divides --hidden"
        ),
    )
    model.add_argument("--ffn", type=int, help="MLP width; default 3.5 x hidden (14336 for 4096)")
    model.add_argument("--seq", type=int, help="sequence length; default 64 on CPU, 4096 on CUDA")
    model.add_argument("--batch", type=int, help="batch size; default 1")
    model.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        help=("parameter and activation dtype; default float32 on CPU, bfloat16 on CUDA"),
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``offload`` command."""
    from offload import __version__

    parser = argparse.ArgumentParser(
        prog="offload",
        description="Activation offloading to pinned host memory for PyTorch training.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"offload {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "profile",
        formatter_class=_HelpFormatter,
        help="measure memory saved and time spent by offloading on a model",
        description=(
            "Run forward + backward of a model without and with activation offloading "
            "and report the memory saved, the step time, copy times and stalls per "
            "layer. Model: the built-in Llama-style reference stack (sizes from the "
            "flags below; defaults sized for the device) or --hf-config. Weights are "
            "random; nothing is downloaded."
        ),
    )
    _add_model_arguments(p)
    run = p.add_argument_group("run")
    run.add_argument("--device", help="cpu, cuda or cuda:N; default cuda when available, else cpu")
    run.add_argument(
        "--offload-layers",
        metavar="auto|all|N|I,J,...",
        help=(
            "auto, all (all but the last), an int n (the first n layers) or a comma list "
            "of layer indices; default auto, the library's default"
        ),
    )
    run.add_argument(
        "--min-tensor-bytes",
        type=int,
        help=(
            "saved tensors smaller than this stay on the device; default 262144 (the "
            "offloader's), 0 on CPU where the default model's tensors are all smaller"
        ),
    )
    run.add_argument(
        "--compress", choices=["fp8"], help="offload compressed (lossy; default: exact)"
    )
    run.add_argument("--steps", type=int, default=3, help="measured steps per phase; default 3")
    run.add_argument("--warmup", type=int, default=1, help="warm-up steps per phase; default 1")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write the profile as JSON")
    out.add_argument(
        "--plot",
        metavar="PATH",
        help=('write the timeline as a PNG (needs matplotlib: pip install "offload[plot]")'),
    )
    _add_plan_parser(sub)
    return parser


def _add_plan_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        formatter_class=_HelpFormatter,
        help="choose offload / recompute per layer for an activation-memory budget",
        description=(
            "Measure a model's step (CUDA) without levers and with each lever on every "
            "layer, then choose per layer keep, offload, selective recompute or "
            "checkpoint to meet --budget at the least predicted step time, and print the "
            "plan. --measure also applies it and measures it. Model: as for "
            "'offload profile'."
        ),
    )
    _add_model_arguments(p)
    run = p.add_argument_group("plan")
    run.add_argument(
        "--budget",
        required=True,
        help=(
            "activation peak allowed: a fraction in (0, 1] of the peak without levers "
            "(0.5), or bytes with an optional unit (12GiB, 800MiB)"
        ),
    )
    run.add_argument(
        "--levers",
        default=",".join(DEFAULT_LEVERS),
        help=f"comma list of the levers the plan may use, of: {', '.join(LEVERS)}; "
        f"default all of them",
    )
    run.add_argument(
        "--model-levers",
        default=",".join(MODEL_LEVERS),
        help=f"comma list of the levers outside the layers the plan may add, of: "
        f"{', '.join(MODEL_LEVERS)} (the LM head and loss in slices, tiled MLPs; taken "
        f"only where the budget needs them); '' for none; default both",
    )
    run.add_argument(
        "--compress", choices=["fp8"], help="offloaded layers travel compressed (lossy)"
    )
    run.add_argument("--device", help="cuda or cuda:N; default cuda")
    run.add_argument(
        "--min-tensor-bytes", type=int, default=256 * 1024, help="of the offloader; default 262144"
    )
    run.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    run.add_argument(
        "--warmup", type=int, default=3, help="warm-up steps per configuration; default 3"
    )
    run.add_argument(
        "--measure",
        action="store_true",
        help="apply the plan and measure its step time and peak against the prediction",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write the plan (and measurement) as JSON")


_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}


def _budget(text: str) -> int | float:
    """``--budget``: a fraction (float in (0, 1]) or bytes with an optional unit."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise CliError(
            f"--budget {text!r}: give a fraction in (0, 1] (0.5) or bytes with a unit "
            f"among {', '.join(u for u in _UNITS if u)} (12GiB)"
        )
    number, unit = match.groups()
    if not unit and "." in number:
        value = float(number)
        if not 0 < value <= 1:
            raise CliError(f"--budget {text}: a fraction must be in (0, 1]")
        return value
    return int(float(number) * _UNITS[unit.lower()])


def _plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    import offload

    _check_sizes(args)
    budget = _budget(args.budget)
    levers = [x.strip() for x in args.levers.split(",") if x.strip()]
    bad = [x for x in levers if x not in LEVERS]
    if bad:
        raise CliError(f"--levers: unknown {bad}; accepted: {','.join(LEVERS)}")
    model_levers = [x.strip() for x in args.model_levers.split(",") if x.strip()]
    bad = [x for x in model_levers if x not in MODEL_LEVERS]
    if bad:
        raise CliError(f"--model-levers: unknown {bad}; accepted: {','.join(MODEL_LEVERS)}")
    if not torch.cuda.is_available():
        raise CliError(
            "offload plan measures step time and device memory, so it needs a CUDA device, "
            "and none is available here; on this machine 'offload profile' runs, and "
            "offload.Plan(layers, levers) applies a plan chosen by hand"
        )
    device = _device(args.device or "cuda")
    if device.type != "cuda":
        raise CliError(
            f"--device={args.device}: offload plan needs a CUDA device (it measures step "
            f"time and device memory); accepted: cuda, cuda:N"
        )
    dtype = _DTYPES[args.dtype or _DEFAULTS[device.type]["dtype"]]
    _check_compress(args.compress, dtype)
    build = _hugging_face if args.hf_config else _reference
    model, layers, loss_fn, description = build(args, device, dtype)

    def step() -> None:
        loss_fn().backward()

    console = Console()
    console.print(f"offload plan: {description}, on {device}; measuring ...")
    try:
        chosen = offload.plan(
            step,
            layers,
            budget=budget,
            model=model,
            levers=levers,
            model_levers=model_levers,
            compress=args.compress,
            min_tensor_bytes=args.min_tensor_bytes,
            steps=args.steps,
            warmup=args.warmup,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    chosen.report(console)
    result = chosen.to_dict()
    if args.measure:
        from offload._planner.verify import measure_step

        chosen.apply(model)
        try:
            got = measure_step(step, max(args.steps, 5), max(args.warmup, 1))
        finally:
            chosen.remove()
        # a plan chosen by plan() has its predictions and its budget
        t, m = cast(float, chosen.predicted_seconds), cast(int, chosen.predicted_bytes)
        budget = cast(int, chosen.budget_bytes)
        console.print(
            f"measured with the plan applied: step {got['seconds'] * 1e3:.1f} ms (predicted "
            f"{t * 1e3:.1f}), activation peak {got['peak_bytes'] / 2**30:.2f} GiB (predicted "
            f"{m / 2**30:.2f}, budget {budget / 2**30:.2f})"
        )
        result["measured_plan"] = got
    if args.json:
        target = Path(args.json)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(result, indent=1) + "\n")
        console.print(f"plan written to {target}")
    return 0


#: The numeric flags both commands check, with their smallest accepted value.
_MINIMUMS = (
    ("layers", 1),
    ("hidden", 1),
    ("heads", 1),
    ("ffn", 1),
    ("seq", 1),
    ("batch", 1),
    ("steps", 1),
    ("warmup", 0),
    ("min_tensor_bytes", 0),
)


def _check_sizes(args: argparse.Namespace) -> None:
    for name, minimum in _MINIMUMS:
        _positive(args, name, minimum)


def _positive(args: argparse.Namespace, name: str, minimum: int = 1) -> None:
    value = getattr(args, name)
    if value is not None and value < minimum:
        flag = "--" + name.replace("_", "-")
        raise CliError(f"{flag}={value}: must be an integer >= {minimum}")


def _device(text: str | None) -> torch.device:
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise CliError(f"--device={text!r}: accepted values are cpu, cuda, cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise CliError(f"--device={text!r}: accepted values are cpu, cuda, cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CliError(f"--device={text}: CUDA is not available here; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CliError(
                f"--device={text}: only {torch.cuda.device_count()} CUDA device(s); "
                f"accepted: cuda:0 .. cuda:{torch.cuda.device_count() - 1}"
            )
    return device


def _offload_layers(text: str | None, num_layers: int) -> int | list[int] | str | None:
    if text is None:  # the library's default (ActivationOffloader, OffloadConfig)
        import dataclasses

        from offload.config import OffloadConfig

        fields: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(OffloadConfig)}
        return fields["offload_layers"]
    if text in ("auto", "all"):
        return text
    accepted = (
        f"accepted: auto, all, an int 0..{num_layers} (the first n layers) or a comma list of "
        f"indices in 0..{num_layers - 1}, e.g. {','.join(map(str, range(min(3, num_layers))))}"
    )
    try:
        if "," not in text:
            n = int(text)
            if not 0 <= n <= num_layers:
                raise CliError(f"--offload-layers={text}: out of range; {accepted}")
            return n
        indices = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CliError(f"--offload-layers={text!r}: not a number; {accepted}") from None
    bad = [i for i in indices if not 0 <= i < num_layers]
    if bad or len(set(indices)) != len(indices):
        raise CliError(f"--offload-layers={text}: bad or repeated indices {bad}; {accepted}")
    return indices


def _check_plot(path: str | None) -> None:
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError(
            f'--plot {path}: matplotlib is not installed; pip install "offload[plot]"'
        ) from None


def _default_heads(hidden: int) -> int:
    """hidden/128 heads (hidden/32 below 1024), lowered to the nearest count that
    divides ``hidden`` (1 always does)."""
    target = max(1, hidden // 128 if hidden >= 1024 else hidden // 32)
    return next(h for h in range(target, 0, -1) if hidden % h == 0)


def _check_compress(compress: str | None, dtype: torch.dtype) -> None:
    """``--compress fp8`` compresses bf16 and fp16 tensors; refuse it on a float32 model,
    where it would compress nothing."""
    if compress is not None and dtype == torch.float32:
        raise CliError(
            f"--compress {compress} compresses bfloat16 and float16 activations (float32 "
            f"ones travel exactly), and the model is float32 (the CPU default), so nothing "
            f"would be compressed; add --dtype bf16 (or fp16)"
        )


def _reference(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Any:
    """The reference stack, its layers and a step function."""
    from offload.models import ReferenceModel

    defaults = _DEFAULTS[device.type]
    layers = args.layers or defaults["layers"]
    hidden = args.hidden or defaults["hidden"]
    heads = args.heads or _default_heads(hidden)
    ffn = args.ffn or max(64, round(hidden * 3.5 / 64) * 64)
    if hidden % heads:
        raise CliError(f"--heads={heads}: must divide --hidden={hidden}")
    seq = args.seq or defaults["seq"]
    batch = args.batch or defaults["batch"]
    torch.manual_seed(0)
    model = ReferenceModel(layers, hidden, heads, ffn, device=device, dtype=dtype)
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype)
    description = (
        f"reference Llama-style stack: {layers} layers, hidden {hidden}, {heads} heads, "
        f"ffn {ffn}, seq {seq}, batch {batch}, {str(dtype).removeprefix('torch.')}"
    )
    return model, list(model.layers), (lambda: model.loss(x)), description


def _first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of ``exc``'s message, at most ``limit`` characters."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    line = lines[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _check_model_type(path: Path, transformers: Any) -> None:
    """A ``model_type`` transformers does not know, in one line (its own message is a
    paragraph of upgrade advice)."""
    file = path / "config.json" if path.is_dir() else path
    try:
        model_type = json.loads(file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # from_pretrained says what is wrong with the file
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        raise CliError(
            f"--hf-config {path}: model_type {model_type!r} is not known to transformers "
            f"{transformers.__version__}; fix model_type in the config, or install a "
            f"transformers that has it"
        )


def _hugging_face(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Any:
    """A Hugging Face causal LM from a config, random weights; its layers; a step."""
    for flag in ("hidden", "heads", "ffn"):
        if getattr(args, flag) is not None:
            raise CliError(
                f"--{flag} does not apply with --hf-config (edit the config instead); "
                f"accepted with --hf-config: --layers, --seq, --batch, --dtype"
            )
    path = Path(args.hf_config)
    if not path.exists():
        raise CliError(f"--hf-config {path}: no such file or folder (a config.json or its folder)")
    try:
        import transformers
    except ImportError:
        raise CliError(
            "--hf-config needs transformers: pip install transformers "
            '(or pip install "offload[dev]")'
        ) from None
    from offload._layers import find_layers

    _check_model_type(path, transformers)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise CliError(f"--hf-config {path}: not a usable config ({_first_line(exc)})") from None
    if args.layers is not None:
        config.num_hidden_layers = args.layers
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(device=device, dtype=dtype).train()
    layers = find_layers(model)
    defaults = _DEFAULTS[device.type]
    seq = args.seq or min(defaults["seq"], getattr(config, "max_position_embeddings", 10**9))
    batch = args.batch or defaults["batch"]
    vocab = config.vocab_size
    tokens = torch.randint(0, vocab, (batch, seq), device=device)
    description = (
        f"{type(model).__name__} from {path}: {len(layers)} layers, seq {seq}, batch {batch}, "
        f"{str(dtype).removeprefix('torch.')}"
    )
    return model, layers, (lambda: model(input_ids=tokens, labels=tokens).loss), description


def _progress(console: Any) -> tuple[Callable[[str, int, int], None], Callable[[], None]]:
    """A rich progress bar shown once the run has taken a few seconds (terminals only)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    started = time.perf_counter()
    state: dict[str, Any] = {"progress": None, "task": None}

    def update(phase: str, done: int, total: int) -> None:
        bar = state["progress"]
        if bar is None:
            if not console.is_terminal or time.perf_counter() - started < _PROGRESS_AFTER_S:
                return
            bar = state["progress"] = Progress(
                TextColumn("profiling: steps {task.fields[phase]} offloading"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
            bar.start()
            state["task"] = bar.add_task("profile", total=total, phase=phase)
        bar.update(state["task"], completed=done, phase=phase)

    def stop() -> None:
        if state["progress"] is not None:
            state["progress"].stop()

    return update, stop


def _profile(args: argparse.Namespace) -> int:
    from rich.console import Console

    import offload

    _check_sizes(args)
    device = _device(args.device)
    dtype = _DTYPES[args.dtype or _DEFAULTS[device.type]["dtype"]]
    _check_compress(args.compress, dtype)
    _check_plot(args.plot)
    build = _hugging_face if args.hf_config else _reference
    model, layers, loss_fn, description = build(args, device, dtype)
    selection = _offload_layers(args.offload_layers, len(layers))
    min_bytes = args.min_tensor_bytes
    if min_bytes is None:
        min_bytes = 0 if device.type == "cpu" else 256 * 1024
    offloader = offload.ActivationOffloader(
        layers, offload_layers=selection, min_tensor_bytes=min_bytes, compress=args.compress
    )

    def step() -> None:
        with offloader:
            loss = loss_fn()
        loss.backward()

    console = Console()
    console.print(f"offload profile: {description}, on {device}")
    update, stop = _progress(console)
    try:
        profile = offload.profile_step(
            step,
            offloader,
            steps=args.steps,
            warmup=args.warmup,
            parameters=model.parameters(),
            on_step=update,
        )
    finally:
        stop()
        offloader.close()
    profile.report(console)
    if args.json:
        target = Path(args.json)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
        console.print(f"profile written to {target}")
    if args.plot:
        profile.plot(args.plot)
        console.print(f"timeline written to {args.plot}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``offload`` command; returns the exit status (0 ok, 2 bad flags).

    Args:
        argv: the arguments without the program name. Default ``None``: ``sys.argv[1:]``.

    Raises:
        SystemExit: from argparse, for ``--help`` and unparsable flags.

    Example:
        >>> main(["profile", "--device", "cpu", "--layers", "2", "--hidden", "64",
        ...       "--seq", "16", "--steps", "1", "--warmup", "0"])  # doctest: +ELLIPSIS
        offload profile: ...
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {"profile": _profile, "plan": _plan}
    if args.command not in commands:
        parser.print_help()
        return 2
    try:
        return commands[args.command](args)
    except CliError as exc:
        print(f"offload {args.command}: error: {exc}", file=sys.stderr)
        return 2
