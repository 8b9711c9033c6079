"""What an offloaded forward did: :class:`OffloadStats` and :class:`LayerStats` (data
only; their rich rendering lives in ``offload/_render.py``)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["KEEP_REASONS", "LayerStats", "OffloadStats", "format_bytes"]

#: Every reason a saved tensor stays on the device.
KEEP_REASONS: tuple[str, ...] = (
    "small",
    "parameter",
    "not_selected",
    "outside_layers",
    "filtered",
    "host_limit",
    "opted_out",
    "shared",
    "device",
    "unsupported",
)


def _reasons() -> dict[str, int]:
    return dict.fromkeys(KEEP_REASONS, 0)


def format_bytes(n: int | float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # unreachable


@dataclasses.dataclass
class LayerStats:
    """One group (one layer call) of a forward.

    Attributes:
        index: position of the call in the forward (0-based).
        offloaded: whether the group was selected for offloading.
        bytes_offloaded: bytes this group sent to the host (each storage once).
        bytes_released: device bytes freed when the group was released (storages whose
            last reference was the offloader's).
        bytes_kept: bytes saved in this group that stayed on the device, by reason.
        d2h_seconds, h2d_seconds, stall_seconds: copy and stall times, ``None`` unless
            timings are recorded.
    """

    index: int
    offloaded: bool
    bytes_offloaded: int = 0
    bytes_kept: dict[str, int] = dataclasses.field(default_factory=_reasons)
    bytes_released: int = 0
    d2h_seconds: float | None = None
    h2d_seconds: float | None = None
    stall_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerStats:
        """The inverse of :meth:`to_dict` (also after a JSON round trip)."""
        return cls(**data)


@dataclasses.dataclass
class OffloadStats:
    """The most recent forward under an offloader, completed by its backward.

    Attributes:
        bytes_offloaded: bytes copied to the host, each storage span counted once (after
            compression, with ``compress="fp8"``: the bytes that crossed the link).
        bytes_kept: bytes of saved tensors that stayed on the device, for every reason
            of :data:`KEEP_REASONS` (0 when unused).
        bytes_by_dtype: offloaded bytes per dtype name (``"bfloat16"``, ``"float8_e4m3fn"``);
            compressed spans under ``"<dtype> as fp8"`` (``"bfloat16 as fp8"``), counted
            after compression (fp8 bytes and their scales).
        compress_bytes_before: with ``compress="fp8"``, the bytes of the spans that were
            compressed, before compression (0 without compression).
        compress_bytes_after: the same spans after compression (fp8 elements and fp32
            scales): ``compress_bytes_after / compress_bytes_before`` is the ratio
            (about 0.51 for bf16, 0.26 for fp32).
        bytes_reloaded: bytes copied back to the device so far (grows during backward).
        bytes_released: device bytes the releases freed: offloaded storages that nothing
            else referenced (a layer output also saved by a layer that is not offloaded,
            or an input the caller still holds, travels but frees nothing). The drop of
            peak memory is measured against this number.
        layers: one :class:`LayerStats` per group, in call order.
        host_pool_bytes: host bytes handed out by the pool now.
        host_pool_reserved_bytes: host bytes the pool holds (pinned where possible).
        host_pool_peak_bytes: most host bytes handed out at once since the pool was made.
        auto: with ``offload_layers="auto"``, what was chosen for this forward and why
            (``"reason"``: one sentence; ``"step"``: ``"probe"`` (a measuring forward),
            ``"plan"`` (the choice) or ``"none"`` (nothing offloaded: a verifying step,
            or nothing hides); ``"phase"``: ``"measure"``, ``"verify"`` or
            ``"settled"``; after a decision also ``"offloaded"`` (this step),
            ``"chosen"``, ``"predicted_ratio"``, ``"measured_ratio"`` (against steps
            without offloading), ``"memory_reason"`` (when memory forced more
            offloading than the link hides), ``"memory"`` (limit, predicted peaks, the
            fewest layers memory needs), ``"scale"``, the ``"costs"`` and link GB/s);
            else ``None``.
    """

    bytes_offloaded: int = 0
    bytes_kept: dict[str, int] = dataclasses.field(default_factory=_reasons)
    bytes_by_dtype: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes_reloaded: int = 0
    bytes_released: int = 0
    layers: list[LayerStats] = dataclasses.field(default_factory=list)
    host_pool_bytes: int = 0
    host_pool_reserved_bytes: int = 0
    host_pool_peak_bytes: int = 0
    auto: dict[str, Any] | None = None
    compress_bytes_before: int = 0
    compress_bytes_after: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (plain ints, floats, strings, lists and dicts)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OffloadStats:
        """The inverse of :meth:`to_dict` (also after a JSON round trip)."""
        fields = dict(data)
        fields["layers"] = [LayerStats.from_dict(la) for la in fields.get("layers", [])]
        return cls(**fields)

    def table(self) -> Any:
        """A :class:`rich.table.Table` with one row per layer and a total row (fits 80
        columns; short headers explained by the legend that :meth:`report` prints)."""
        from offload import _render

        return _render.layer_table(self, "offload: saved tensors of the last forward")

    def summary(self) -> str:
        """One line: sent, kept by reason (non-zero only), host pool."""
        from offload import _render

        return _render.stats_summary(self)

    def report(self, console: Any = None) -> None:
        """Print the table, a legend line and the summary with rich (``console``:
        a :class:`rich.console.Console`; default a new one on stdout)."""
        from offload import _render

        _render.render_stats(self, console)
