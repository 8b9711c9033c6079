"""The cost model fitted to the user's step: the configurations :func:`offload.plan`
measures and the :class:`~offload._planner.costs.PlanCosts` they give.

Configurations, each ``warmup + steps`` steps on the same model and state: nothing; an
offloader with ``offload_layers="auto"`` (its warm measuring forward gives each layer's
forward and backward time and saved bytes, and the link bandwidth; ``cost_steps`` steps
at most); every layer but the last offloaded; every layer selective; every layer
checkpointed, by each scheme of full recompute in ``scheme_rounds`` alternating rounds
(levers not allowed are skipped; the counts are fields of :class:`PlannerSettings`); on CUDA, one more step without levers records the allocator's peak between
every two layer boundaries, which gives the workspace of the layers' forwards and
backwards and that of the head apart. The recompute fractions ``rho_sel`` and ``rho_ckpt`` are fitted so that the
model predicts the measured peaks of the every-layer configurations; with
``compress="fp8"``, a per-layer codec time so that it predicts the every-layer offload
step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from offload._core import _measure
from offload._planner import verify
from offload._planner.costs import PlanCosts
from offload._planner.levers import RECOMPUTE_KIND, KeptKeys, Recompute
from offload._planner.model_levers import ModelLeverSet
from offload._planner.settings import DEFAULT_PLANNER, PlannerSettings
from offload._recompute._reentrant import RECOMPUTES, NestedBackwardError
from offload.profiling._timeline import Recorder

__all__ = [
    "Measured", "find_model", "fit_costs", "measure_configs",
    "measure_model_levers", "memory_moments", "moments_of", "variant_costs",
]  # fmt: skip


@dataclasses.dataclass
class Measured:
    """What :func:`measure_configs` measured.

    Attributes:
        configs: per configuration name (``"none"``, ``"offload"``, ``"selective"``,
            ``"checkpoint"``): ``measure_step``'s dict (seconds, peak bytes, times).
        forward_s, backward_s, saved_bytes: per layer, from the measuring forward.
        link_bytes: per layer, the bytes offloading it sends (compressed when asked).
        d2h_bps, h2d_bps: the link, bytes per second each way.
        gap_s: device seconds between the last layer's forward and its backward.
        learnt: per layer, what the selective configuration's recompute never used
            (``None`` when it was not measured).
        moments: ``(W, H)`` measured at each moment of the step without levers
            (:func:`memory_moments`), or ``None``.
        recompute: the scheme of the full recompute (``RECOMPUTES``) whose every-layer
            step measured faster; ``configs["checkpoint"]`` is its measurement.
    """

    configs: dict[str, dict[str, Any]]
    forward_s: list[float]
    backward_s: list[float]
    saved_bytes: list[int]
    link_bytes: list[int]
    d2h_bps: float
    h2d_bps: float
    gap_s: float
    learnt: list[KeptKeys] | None = None
    moments: tuple[int, int] | None = None
    recompute: str = "non_reentrant"


@contextlib.contextmanager
def _attached(layers: list[torch.nn.Module], model: torch.nn.Module, **kw: Any) -> Iterator[Any]:
    """An ``ActivationOffloader(layers, **kw)`` attached to ``model``; detached and
    closed (its host memory freed) on exit."""
    from offload.activations import ActivationOffloader

    off = ActivationOffloader(layers, **kw)
    handle = off.attach(model)
    try:
        yield off
    finally:
        handle.remove()
        off.close()


def _with_offloader(
    step_fn: Callable[[], Any], layers: list[torch.nn.Module], model: torch.nn.Module, **kw: Any
) -> tuple[dict[str, Any], Any]:
    """Measure ``step_fn`` with an offloader over ``layers`` attached to ``model``;
    returns the measurement and the offloader's last stats."""
    steps, warmup = kw.pop("steps"), kw.pop("warmup")
    with _attached(layers, model, **kw) as off:
        return verify.measure_step(step_fn, steps, warmup), off.stats


def find_model(step_fn: Callable[[], Any], layers: Sequence[torch.nn.Module]) -> torch.nn.Module:
    """The module whose forward runs ``layers`` in ``step_fn``: the outermost module call
    in progress at every layer call, seen through global module hooks during one run of
    ``step_fn`` (which counts as a warm-up step: gradients accumulate).

    Raises:
        ValueError: ``step_fn`` called no layer, or called one outside any other
            module's forward, or called them from different outermost modules: pass
            ``model=`` then.
    """
    from torch.nn.modules import module as _module

    ids = {id(layer) for layer in layers}
    calls: list[torch.nn.Module] = []  # the module calls in progress, outermost first
    seen: list[torch.nn.Module | None] = []  # per layer call: its outermost module

    def pre(module: torch.nn.Module, args: Any) -> None:
        if id(module) in ids:
            outer = calls[0] if calls else None
            seen.append(None if outer is None or id(outer) in ids else outer)
        calls.append(module)

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        if calls and calls[-1] is module:
            calls.pop()

    handles = [
        _module.register_module_forward_pre_hook(pre),
        _module.register_module_forward_hook(post, always_call=True),
    ]
    try:
        step_fn()
    finally:
        for h in handles:
            h.remove()
    found = {id(m): m for m in seen if m is not None}
    if not seen or None in seen or len(found) != 1:
        why = (
            "step_fn called none of the layers"
            if not seen
            else "step_fn calls the layers outside any other module's forward"
            if None in seen
            else f"the layers ran inside {len(found)} different top-level modules"
        )
        raise ValueError(
            f"model: {why}, so plan cannot tell which forward to enter its measuring "
            f"offloaders around; pass model=, the nn.Module whose forward calls the layers"
        )
    return next(iter(found.values()))


def _device_of(layers: Sequence[torch.nn.Module]) -> torch.device:
    for layer in layers:
        for t in (*layer.parameters(), *layer.buffers()):
            return t.device
    return torch.device("cpu")


def memory_moments(
    step_fn: Callable[[], Any], layers: Sequence[torch.nn.Module], saved: Sequence[int]
) -> tuple[int, int] | None:
    """``(W, H)`` of the step without levers (``offload/_planner/costs.py``): one step
    with the allocator's peak read and reset at every layer boundary. ``W``: the most
    any layer's forward or backward allocates beyond the layers' saved bytes held at
    that moment (``saved``: per layer); ``H``: the most allocated between the last
    layer's forward and its backward beyond all of them. ``None`` off CUDA, or when
    the boundaries are not those of one call per layer."""
    device = _device_of(layers)
    if device.type != "cuda":
        return None
    rec = Recorder(device, peaks=True)
    _measure.settle(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    handles = rec.attach(layers)
    try:
        step_fn()
    finally:
        for h in handles:
            h.remove()
    torch.cuda.synchronize(device)
    marks = list(rec.peaks or [])
    marks.append(("end", -1, torch.cuda.max_memory_allocated(device)))
    return moments_of(marks, before, saved)


def moments_of(
    marks: Sequence[tuple[str, int, int]], before: int, saved: Sequence[int]
) -> tuple[int, int] | None:
    """``(W, H)`` from the peaks :func:`memory_moments` read: ``marks`` in time order,
    each ``(kind, layer, bytes)`` with the most allocated since the mark before;
    ``before``: allocated when the step started; ``saved``: per layer."""
    L = len(saved)
    held = [0]
    for s in saved:
        held.append(held[-1] + s)
    forward: list[int] = []
    backward: list[int] = []
    head = None
    # the peak read at a mark is that of the span since the mark before: the span
    # after a layer's forward start is its forward, after its backward start its
    # backward (which the next mark ends, whatever its kind: the next layer's backward
    # start and this one's end are hooks on the same tensor)
    for (kind, i, _), (_, _, peak) in zip(marks, marks[1:]):
        if not 0 <= i < L:
            return None
        grown = peak - before
        if kind == "forward_start":
            forward.append(grown - held[i + 1])
        elif kind == "forward_end" and i == L - 1:
            head = grown - held[L]
        elif kind == "backward_start":
            backward.append(grown - held[i + 1])
    if head is None or len(forward) != L or not backward:
        return None
    return max(0, max(forward + backward)), max(0, head)


def _layer_costs(
    step_fn: Callable[[], Any],
    layers: list[torch.nn.Module],
    model: torch.nn.Module,
    min_tensor_bytes: int,
    settings: PlannerSettings = DEFAULT_PLANNER,
) -> dict[str, Any]:
    """The measuring forward of ``offload_layers="auto"``, warm: per-layer costs and the
    link (uncompressed bytes); steps run until two consecutive steps report warm costs
    that agree (:func:`_agree`; at most ``settings.cost_steps``, else the last report)."""
    auto: dict[str, Any] = {}
    last: list[float] | None = None
    with _attached(layers, model, offload_layers="auto", min_tensor_bytes=min_tensor_bytes) as off:
        for _ in range(settings.cost_steps):
            step_fn()
            auto = off.stats.auto or {}
            if "costs" not in auto or auto.get("cold") is not False:
                continue
            now = [float(c["forward_s"]) + float(c["backward_s"]) for c in auto["costs"]]
            if last is not None and _agree(now, last, settings.cost_agree):
                break
            last = now
    if "costs" not in auto:
        raise RuntimeError(
            f"the measuring forward did not produce layer costs ({auto.get('reason')!r}); "
            f"does step_fn call model's forward once per step?"
        )
    if len(auto["costs"]) != len(layers):
        raise RuntimeError(
            f"the measuring forward saw {len(auto['costs'])} layer calls for {len(layers)} "
            f"layers: each layer must be called once per forward"
        )
    return auto


def _agree(a: list[float], b: list[float], tolerance: float) -> bool:
    """Two reports of per-layer seconds within ``tolerance`` (relative) of each other, layer by
    layer: the costs of one warm measurement, not the first one's scaled to a warm
    step's time (a cold step's one-time costs do not fall evenly on its layers)."""
    return len(a) == len(b) and all(abs(x - y) <= tolerance * max(x, y) for x, y in zip(a, b))


def measure_configs(
    step_fn: Callable[[], Any],
    layers: list[torch.nn.Module],
    model: torch.nn.Module,
    allowed: Sequence[str],
    compress: str | None,
    min_tensor_bytes: int,
    steps: int,
    warmup: int,
    settings: PlannerSettings = DEFAULT_PLANNER,
) -> Measured:
    """Run the configurations of the module docstring (levers not in ``allowed``
    skipped) and collect what the cost model needs."""
    L = len(layers)
    configs: dict[str, dict[str, Any]] = {"none": verify.measure_step(step_fn, steps, warmup)}
    auto = _layer_costs(step_fn, layers, model, min_tensor_bytes, settings)
    saved = [int(c["nbytes"]) for c in auto["costs"]]
    moments = memory_moments(step_fn, layers, saved)
    link = list(saved)
    if ("offload" in allowed or "selective_offload" in allowed) and L > 1:
        configs["offload"], stats = _with_offloader(
            step_fn,
            layers,
            model,
            offload_layers="all",
            compress=compress,
            min_tensor_bytes=min_tensor_bytes,
            steps=steps,
            warmup=warmup,
        )
        moved = sum(saved[: L - 1])
        if moved and compress is not None:
            ratio = stats.bytes_offloaded / moved
            link = [int(s * ratio) for s in saved]
    learnt: list[KeptKeys] | None = None
    if any(RECOMPUTE_KIND.get(x) == "selective" for x in allowed):
        configs["selective"], wrappers = _with_recompute(
            step_fn, layers, "selective", steps, warmup
        )
        learnt = [w.kept for w in wrappers]
    recompute = "non_reentrant"
    if any(RECOMPUTE_KIND.get(x) == "checkpoint" for x in allowed):
        schemes = _measure_schemes(step_fn, layers, steps, warmup, settings.scheme_rounds)
        recompute = _faster_scheme(schemes, settings.scheme_tie)
        configs["checkpoint"] = {**schemes[recompute], "recompute": recompute}
        for scheme, got in schemes.items():
            configs[f"checkpoint ({scheme})"] = got
    return Measured(
        configs=configs,
        forward_s=[float(c["forward_s"]) for c in auto["costs"]],
        backward_s=[float(c["backward_s"]) for c in auto["costs"]],
        saved_bytes=saved,
        link_bytes=link,
        d2h_bps=auto["d2h_gbps"] * 1e9,
        h2d_bps=auto["h2d_gbps"] * 1e9,
        gap_s=float(auto.get("gap_s", 0.0)),
        learnt=learnt,
        moments=moments,
        recompute=recompute,
    )


def _measure_schemes(
    step_fn: Callable[[], Any],
    layers: list[torch.nn.Module],
    steps: int,
    warmup: int,
    repeats: int,
) -> dict[str, dict[str, Any]]:
    """Checkpointing every layer by each scheme of full recompute (Note [full recompute]
    in recompute.py: neither wins everywhere), in ``repeats`` alternating
    rounds (the host's speed drifts within a process, and a recompute the host paces
    follows it); a scheme whose backward raised ``NestedBackwardError`` (a step that
    takes gradients by ``torch.autograd.grad``) or under which a layer parameter got no
    gradient that torch's scheme gave it (``autograd.grad`` asking for the parameters
    never runs the reentrant backward) is left out. Returns each kept scheme's
    measurement, its rounds' steps merged."""
    rounds: dict[str, list[dict[str, Any]]] = {}
    reached: dict[str, set[int]] = {}
    failed: set[str] = set()
    for r in range(repeats):
        for scheme in RECOMPUTES if r % 2 == 0 else RECOMPUTES[::-1]:
            if scheme in failed:
                continue
            with _gradients_seen(layers) as seen:
                try:
                    got = _with_recompute(step_fn, layers, "checkpoint", steps, warmup, scheme)[0]
                except NestedBackwardError:
                    failed.add(scheme)
                    continue
            rounds.setdefault(scheme, []).append(got)
            reached[scheme] = reached.get(scheme, set()) | seen
    if "reentrant" in rounds and reached["reentrant"] != reached.get("non_reentrant"):
        del rounds["reentrant"]
    out: dict[str, dict[str, Any]] = {}
    for scheme, runs in rounds.items():
        times = [t for g in runs for t in g["times"]]
        host = [t for g in runs for t in g.get("host_times", [])]
        peaks = [g["peak_bytes"] for g in runs if g["peak_bytes"] is not None]
        out[scheme] = {
            "seconds": float(statistics.median(times)),
            "peak_bytes": max(peaks) if peaks else None,
            "times": times,
            "host_times": host,
        }
    return out


def _faster_scheme(schemes: dict[str, dict[str, Any]], tie: float) -> str:
    """The scheme with the shorter median step; within ``tie`` (relative) of each other,
    the one with the shorter median host time: where the host paces the step, the
    scheme that asks less of it is the one that stays fast when the host slows down."""
    fastest = min(schemes, key=lambda k: schemes[k]["seconds"])
    best = schemes[fastest]["seconds"]
    tied = [k for k in schemes if schemes[k]["seconds"] <= best * (1 + tie)]
    if len(tied) > 1 and all(schemes[k]["host_times"] for k in tied):
        return min(tied, key=lambda k: statistics.median(schemes[k]["host_times"]))
    return fastest


@contextlib.contextmanager
def _gradients_seen(layers: list[torch.nn.Module]) -> Iterator[set[int]]:
    """The indices (in the layers' parameter order) of the parameters whose gradient
    was computed while the block ran (a tensor hook on each, removed after)."""
    seen: set[int] = set()
    params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    hooks = [
        p.register_hook(lambda g, i=i: seen.add(i)) for i, p in enumerate(params)
    ]  # fmt: skip
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def _with_recompute(
    step_fn: Callable[[], Any],
    layers: list[torch.nn.Module],
    lever: str,
    steps: int,
    warmup: int,
    recompute: str = "non_reentrant",
) -> tuple[dict[str, Any], list[Recompute]]:
    """``measure_step`` with ``lever`` on every layer; the wrappers (removed)."""
    wrappers = [Recompute(layer, lever, recompute=recompute) for layer in layers]
    try:
        return verify.measure_step(step_fn, steps, warmup), wrappers
    finally:
        for w in reversed(wrappers):
            w.remove()


def _fit(f: Callable[[float], float], target: float, hi: float) -> float:
    """The ``x`` in ``[0, hi]`` with ``f(x)`` closest to ``target`` (``f`` grows)."""
    lo = 0.0
    if f(lo) >= target:
        return lo
    if f(hi) <= target:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def fit_costs(m: Measured, compress: str | None) -> tuple[PlanCosts, dict[str, Any]]:
    """The cost model of ``m``, and the fitted values (``selective_kept``,
    ``checkpoint_kept``, ``offload_s``) by name."""
    L = len(m.forward_s)
    base_s, base_m = m.configs["none"]["seconds"], m.configs["none"]["peak_bytes"]
    total_f = sum(m.forward_s) or 1.0
    if m.moments is not None:
        workspace, head = m.moments
    else:
        workspace, head = int(max(0.0, base_m - sum(m.saved_bytes))), None

    def shares(lever: str) -> tuple[float, ...]:
        extra_s = m.configs.get(lever, {}).get("seconds", base_s) - base_s
        return tuple(max(0.0, extra_s) * f / total_f for f in m.forward_s)

    def model_costs(**kw: Any) -> PlanCosts:
        fields: dict[str, Any] = dict(
            forward_s=m.forward_s,
            backward_s=m.backward_s,
            saved_bytes=m.saved_bytes,
            link_bytes=m.link_bytes,
            selective_kept=1.0,
            checkpoint_kept=1.0,
            selective_s=shares("selective"),
            checkpoint_s=shares("checkpoint"),
            d2h_bps=m.d2h_bps,
            h2d_bps=m.h2d_bps,
            workspace_bytes=workspace,
            head_bytes=head,
            gap_s=m.gap_s,
            step_s=base_s,
            activation_bytes=int(base_m),
        )
        fields.update(kw)
        return PlanCosts(**fields)

    fitted: dict[str, Any] = {}
    for lever, name in (("selective", "selective_kept"), ("checkpoint", "checkpoint_kept")):
        if lever in m.configs:
            target = m.configs[lever]["peak_bytes"]

            def memory(x: float, n: str = name, lv: str = lever) -> float:
                return model_costs(**{**fitted, n: x}).memory([lv] * L)

            fitted[name] = _fit(memory, target, 1.0)
    if compress is not None and "offload" in m.configs:
        # the codec's kernels and the waits they add are not in the copy model: fit one
        # cost per offloaded layer to the every-layer offload step
        levers_all = ["offload"] * (L - 1) + ["keep"]
        residual = m.configs["offload"]["seconds"] - model_costs(**fitted).seconds(levers_all)
        per_layer = max(0.0, residual) / (L - 1)
        fitted["offload_s"] = tuple(per_layer for _ in range(L))
    return model_costs(**fitted), fitted


# --------------------------------------------------------------------------------------
# model levers (offload/_planner/model_levers.py): the step measured with each set


def _saved_counts(
    step_fn: Callable[[], Any],
    layers: list[torch.nn.Module],
    model: torch.nn.Module,
    min_tensor_bytes: int,
) -> list[int]:
    """Per layer, the bytes it saves for backward (offloaded, or kept by the last layer
    as not selected), counted by one step with ``offload_layers="all"``."""
    with _attached(layers, model, offload_layers="all", min_tensor_bytes=min_tensor_bytes) as off:
        step_fn()
        return [
            int(la.bytes_offloaded + la.bytes_kept.get("not_selected", 0))
            for la in off.stats.layers
        ]


def measure_model_levers(
    step_fn: Callable[[], Any],
    layers: list[torch.nn.Module],
    model: torch.nn.Module,
    causal: torch.nn.Module | None,
    keys: Sequence[tuple[str, ...]],
    saved: Sequence[int],
    min_tensor_bytes: int,
    steps: int,
    warmup: int,
    *,
    slice_tokens: int | str = "auto",
    tile_tokens: int | str = "auto",
) -> dict[tuple[str, ...], dict[str, Any]]:
    """Per set of model levers in ``keys`` (each non-empty): the step without layer
    levers with the set applied (``"config"``: ``measure_step``'s dict), what each layer
    saves under it (``"saved"``: ``saved``, the bytes measured without it, scaled per
    layer by what one counting step with and without it saw, when the set tiles the
    MLPs), its memory moments (``"moments"``: ``(W, H)`` or ``None``) and how many
    calls each lever acted on (``"calls"``); or ``{"error": why}`` when the step raised
    with the set applied, or a lever of it acted on no call (the step never passes
    ``labels`` to the causal LM; no MLP call is longer than a tile): not a candidate."""
    out: dict[tuple[str, ...], dict[str, Any]] = {}
    base_counts: list[int] | None = None
    if any("tiled_mlp" in key for key in keys):
        base_counts = _saved_counts(step_fn, layers, model, min_tensor_bytes)
    for key in keys:
        levers = ModelLeverSet(
            key, layers, causal, slice_tokens=slice_tokens, tile_tokens=tile_tokens
        )
        try:
            with levers:
                got = verify.measure_step(step_fn, steps, warmup)
                calls = levers.calls()
                layer_saved = [int(s) for s in saved]
                if "tiled_mlp" in key and base_counts is not None:
                    counts = _saved_counts(step_fn, layers, model, min_tensor_bytes)
                    layer_saved = [
                        int(s * c / b) if b else int(s)
                        for s, c, b in zip(saved, counts, base_counts)
                    ]
                moments = memory_moments(step_fn, layers, layer_saved)
        except Exception as exc:  # the user's step with the levers: not a candidate
            out[key] = {"error": f"the step raised {type(exc).__name__} with them: {exc}"}
            continue
        idle = [name for name, n in calls.items() if n == 0]
        if idle:
            why = {
                "sliced_head": "the step never called the causal LM with labels",
                "tiled_mlp": "no MLP call was longer than a tile",
            }
            out[key] = {"error": "; ".join(f"{name}: {why[name]}" for name in idle)}
            continue
        out[key] = {"config": got, "saved": layer_saved, "moments": moments, "calls": calls}
    return out


def variant_costs(base: PlanCosts, key: tuple[str, ...], got: dict[str, Any]) -> PlanCosts:
    """The cost model of the step with the model levers ``key`` applied: ``base`` (fitted
    without them) with that step's figures (:func:`measure_model_levers`): its time and
    peak without layer levers (the anchors), what each layer saves, the workspace and
    the head's memory; the recompute fractions keep the bytes a recomputed layer holds
    (its inputs, which no model lever changes), so they scale by the saved bytes' ratio.
    The recompute levers' extra times are those measured without the set."""
    saved = list(got["saved"])
    before, now = sum(base.saved_bytes), sum(saved)
    ratio = before / now if now else 1.0
    peak = got["config"]["peak_bytes"]
    if got.get("moments") is not None:
        workspace, head = got["moments"]
    else:
        workspace, head = int(max(0.0, peak - now)), None
    link = [
        int(x * s / b) if b else int(s)
        for x, s, b in zip(base._link(), saved, base.saved_bytes)
    ]  # fmt: skip
    return dataclasses.replace(
        base,
        saved_bytes=tuple(saved),
        link_bytes=tuple(link),
        workspace_bytes=int(workspace),
        head_bytes=None if head is None else int(head),
        step_s=float(got["config"]["seconds"]),
        activation_bytes=int(peak),
        selective_kept=min(1.0, base.selective_kept * ratio),
        checkpoint_kept=min(1.0, base.checkpoint_kept * ratio),
        model_levers=tuple(key),
    )
