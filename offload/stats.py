"""What one forward under an offloader did, as data only: :class:`OffloadStats` with one
:class:`LayerStats` per layer call, and the reasons a saved tensor stays on the device.
The runtime writes them; ``offload.profiling`` renders them (Note [rendering])."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["KEEP_REASONS", "LayerStats", "OffloadStats"]

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
        recomputed: the call ran recomputed (torch's non-reentrant checkpoint), only its
            inputs saved and offloaded: host memory could not hold its saves, or device
            memory needed more than the link hides (``offload_layers="auto"``).

    Example:
        >>> import offload, torch
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(2))
        >>> off = offload.ActivationOffloader(layers, offload_layers=1, min_tensor_bytes=0)
        >>> x = torch.randn(512, 256, requires_grad=True)
        >>> with off:
        ...     y = layers[1](layers[0](x))
        >>> first, second = off.stats.layers
        >>> first.offloaded, first.bytes_offloaded == x.nbytes  # layer 0 saved x
        (True, True)
        >>> second.offloaded, second.bytes_offloaded
        (False, 0)
        >>> y.sum().backward()
        >>> off.close()
    """

    index: int
    offloaded: bool
    bytes_offloaded: int = 0
    bytes_kept: dict[str, int] = dataclasses.field(default_factory=_reasons)
    bytes_released: int = 0
    d2h_seconds: float | None = None
    h2d_seconds: float | None = None
    stall_seconds: float | None = None
    recomputed: bool = False

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
        layers: one :class:`LayerStats` per group, in call order. A forward that
            offloads nothing tracks its first call only: the later calls are listed
            with zeros, and ``bytes_kept`` counts what was saved before the second call.
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
            fewest layers memory needs), ``"scale"``, the ``"costs"`` and link GB/s,
            ``"cold"``: ``True`` while those costs come from the offloader's first
            step alone, which is measured again warm);
            else ``None``.
        synchronous: ``True`` when the copies ran synchronously because the offloaded
            tensors live on a device without an accelerator (the CPU): the schedule runs
            as on a GPU and moves the bytes to host memory, but there is no device
            memory to save; :meth:`report` and :meth:`summary` say so instead of
            reporting freed device memory.

    Example:
        >>> import offload, torch
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(3))
        >>> off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
        >>> x = torch.randn(512, 256, requires_grad=True)
        >>> with off:
        ...     h = x
        ...     for layer in layers:
        ...         h = torch.relu(layer(h))
        >>> h.sum().backward()
        >>> stats = off.stats
        >>> [layer.offloaded for layer in stats.layers]  # "all": every call but the last
        [True, True, False]
        >>> stats.bytes_reloaded == stats.bytes_offloaded == 2 * x.nbytes
        True
        >>> off.close()
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
    synchronous: bool = False

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
        return _renderer().layer_table(self, "offload: saved tensors of the last forward")

    def summary(self) -> str:
        """One line: sent, kept by reason (non-zero only), host pool."""
        return _renderer().stats_summary(self)

    def report(self, console: Any = None) -> None:
        """Print the table, a legend line and the summary with rich (``console``:
        a :class:`rich.console.Console`; default a new one on stdout)."""
        _renderer().render_stats(self, console)


# Note [rendering]
# ~~~~~~~~~~~~~~~~
# The runtime writes these classes and never imports reporting (rich tables, plots),
# which sits above it. So ``table()``, ``summary()`` and ``report()`` call the module
# that ``offload.profiling`` registers here when it is imported (``import offload``
# imports it): the data never imports its rendering.
_RENDERER: list[Any] = []


def register_renderer(module: Any) -> None:
    """Called by ``offload.profiling`` on import: the module that renders these classes."""
    _RENDERER[:] = [module]


def _renderer() -> Any:
    if not _RENDERER:  # pragma: no cover - `import offload` imports offload.profiling
        raise RuntimeError("offload.profiling is not imported: `import offload` first")
    return _RENDERER[0]
