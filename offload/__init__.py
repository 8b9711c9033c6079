"""offload: move what a training step keeps for the backward into pinned host memory.

Wrap the forward in an offloader: the tensors autograd saves inside the given layers are
copied to host memory on side streams while the device computes, and come back during
the backward, one layer ahead of need. Gradients are bitwise those without offloading.

Example:
    >>> import torch, offload
    >>> layers = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(4))
    >>> offloader = offload.ActivationOffloader(layers, offload_layers="all")
    >>> x = torch.randn(256, 512, requires_grad=True)
    >>> with offloader:                    # the forward only
    ...     y = x
    ...     for layer in layers:
    ...         y = layer(y).relu()
    >>> y.sum().backward()                 # reloads happen here
    >>> offloader.stats.bytes_offloaded > 0
    True
    >>> offloader.close()

Also: ``attach`` (loops you do not own), ``WeightOffloader``, ``checkpoint``, ``plan``,
``compress="fp8"``, ``sliced_head_loss`` and ``tile_mlp`` (long sequences),
``make_graphed_callables``, ``get_cpu_offload_context``
(TransformerEngine's API), ``profile_step``, and the ``offload`` command. Importing the
package touches no CUDA state: no streams, events or pinned memory are created until the
first forward that offloads something.
"""

from offload import integrations, main_grad, nn
from offload._layers import find_layers
from offload._planner.costs import PlanCosts
from offload._planner.levers import DEFAULT_LEVERS, LEVERS
from offload._planner.model_levers import MODEL_LEVERS
from offload._planner.plan import Plan, plan
from offload._recompute._checkpoint import (
    CheckpointOffloader,
    CheckpointStats,
    checkpoint,
    checkpoint_stats,
)
from offload._recompute._head import SlicedHeadHandle, sliced_cross_entropy, sliced_head_loss
from offload._recompute._tiled import TiledHandle, tile_mlp
from offload.activations import ActivationOffloader, no_offload
from offload.activations._attach import AttachHandle
from offload.activations._auto._short import ActivationMemoryError
from offload.activations._graphs import make_graphed_callables
from offload.activations._manual import ManualOffloadSynchronizer
from offload.config import OffloadConfig
from offload.integrations.te import get_cpu_offload_context, mark_not_offload, start_offload
from offload.profiling._profile import MemoryProfile, profile_step
from offload.stats import LayerStats, OffloadStats
from offload.weights import WeightOffloader

__version__ = "0.2.0"

__all__ = [
    # activation offloading
    "ActivationOffloader",
    "AttachHandle",
    "OffloadConfig",
    "ActivationMemoryError",
    "no_offload",
    # CUDA graphs: offloading inside per-layer graphs
    "make_graphed_callables",
    # TransformerEngine-compatible API
    "get_cpu_offload_context",
    "ManualOffloadSynchronizer",
    "mark_not_offload",
    "start_offload",
    # checkpointing: checkpoint inputs in host memory
    "checkpoint",
    "CheckpointOffloader",
    "CheckpointStats",
    "checkpoint_stats",
    # weight offloading
    "WeightOffloader",
    # layers with fused weight-gradient accumulation
    "nn",
    "main_grad",
    # discovery and integrations
    "find_layers",
    "integrations",
    # statistics
    "OffloadStats",
    "LayerStats",
    # profiling: measure the savings on your own model
    "profile_step",
    "MemoryProfile",
    # planning: a lever per layer (offload, recompute) for a memory budget
    "plan",
    "Plan",
    "PlanCosts",
    "LEVERS",
    "DEFAULT_LEVERS",
    "MODEL_LEVERS",
    # long sequences: the LM head and loss in slices, sequence-tiled MLPs
    "sliced_head_loss",
    "SlicedHeadHandle",
    "sliced_cross_entropy",
    "tile_mlp",
    "TiledHandle",
]
