"""FSDP2 (``torch.distributed.fsdp.fully_shard``): fused weight-gradient accumulation.

``use_fused_wgrad(model)`` makes the fused layers of ``offload.nn`` (built with
``fuse_wgrad_accumulation=True``) write their weight gradient straight into the gradient
that FSDP2 reduce-scatters, in FSDP's reduce dtype (fp32 with
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``), with
no ``main_grad`` and no persistent full-size buffer per parameter (docs/design.md 4.9).

How FSDP2 handles an unsharded parameter's gradient (torch/distributed/fsdp/_fully_shard,
torch 2.11 and 2.13):

- Each managed parameter has an ``FSDPParam``. Before a module's forward and backward,
  its ``_unsharded_param`` (one ``nn.Parameter`` object, created at the first
  all-gather and reused afterwards; its storage is freed and refilled) is set on the
  module, so the autograd Function receives and weakly references that object.
- After the module's backward, ``FSDPParamGroup.post_backward`` collects, per
  parameter, ``fsdp_param.unsharded_accumulated_grad`` if it is set, else
  ``unsharded_param.grad``, casts to the reduce dtype, copies everything into one
  reduce-scatter input and drops its references (the unsharded gradients are freed).
  When gradient sync is off (``set_requires_gradient_sync(False)``) it reduces nothing:
  a ``.grad`` whose dtype differs from the reduce dtype is moved into
  ``unsharded_accumulated_grad`` (upcast), and later ``.grad`` contributions are added
  into it; the next synced backward reduce-scatters the accumulated gradient.

What does not work, and why:

- Returning an fp32 dW for a bf16 parameter from the autograd Function: autograd casts a
  returned gradient to the input's dtype (bf16), which materialises the bf16 dW and
  loses the fp32 accumulation. (torch 2.11 and 2.13 let one set ``param.grad_dtype =
  torch.float32`` to keep it fp32, but then each micro-batch's dW is a separate
  allocation that ``AccumulateGrad`` adds afterwards: no GEMM with beta = 1.)
- Assigning ``unsharded_param.grad = fp32_tensor``: rejected (the gradient's dtype must
  match the parameter's).

What works (the mechanism used): the fused layer writes into FSDP's own
``unsharded_accumulated_grad`` of that ``FSDPParam``:

- none there (the first backward after a reduce-scatter): allocate it
  (``torch.empty``, reduce dtype, or the parameter's dtype when FSDP does not cast) and
  write dW with beta = 0: this is the case "FSDP will reduce-scatter after this
  backward" and the first micro-batch of an accumulation;
- already there (gradient sync was off for an earlier micro-batch, gradients accumulate
  unsharded): add with beta = 1.

Either way the function returns no gradient for the weight, so ``.grad`` stays None and
FSDP's ``post_backward`` finds the buffer, reduce-scatters it and drops it. The buffer
exists only from a parameter's first backward of a step until its reduce-scatter, as
FSDP's own unsharded gradients do.

One more step is needed: ``foreach_reduce`` requires one gradient dtype per parameter
group, and the group's other parameters (biases, norms, a router) get their ``.grad`` in
the parameter dtype. ``use_fused_wgrad`` therefore wraps the ``post_backward`` of each
parameter group that holds a fused weight: before FSDP's own code runs, any ``.grad`` in
another dtype than the group's accumulated gradients is moved into
``unsharded_accumulated_grad`` (upcast, exactly what FSDP does itself when gradient sync
is off).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from offload.nn import GroupedLinear, Linear

__all__ = ["use_fused_wgrad"]


def _param_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13: several groups
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)  # torch 2.11: one group
    return [] if group is None else [group]


def _fused_weight_names(module: nn.Module) -> set[str]:
    if isinstance(module, Linear) and module.fuse_wgrad_accumulation:
        return {"weight"}
    if isinstance(module, GroupedLinear) and module.fuse_wgrad_accumulation:
        return {f"weight{i}" for i in range(module.num_experts)}
    return set()


def _unify_grad_dtypes(group: Any) -> None:
    """Move ``.grad``s whose dtype differs from the group's accumulated grads into them."""
    params = group.fsdp_params
    dtype = None
    for fsdp_param in params:
        acc = fsdp_param.unsharded_accumulated_grad
        if acc is not None:
            dtype = acc.dtype
            break
    if dtype is None:
        return
    with torch.no_grad():
        for fsdp_param in params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is None or unsharded.grad is None or unsharded.grad.dtype == dtype:
                continue
            grad = unsharded.grad
            unsharded.grad = None
            if fsdp_param.unsharded_accumulated_grad is None:
                fsdp_param.unsharded_accumulated_grad = grad.to(dtype)
            else:
                fsdp_param.unsharded_accumulated_grad += grad


class _PostBackwardUniformDtype:
    """Stands in for ``FSDPParamGroup.post_backward`` on groups with fused weights.

    Calls ``_unify_grad_dtypes(group)`` and then FSDP's original bound method.
    """

    def __init__(self, group: Any, original: Any) -> None:
        self.group = group
        self.original = original

    def __call__(self, *args: Any) -> Any:
        _unify_grad_dtypes(self.group)
        return self.original(*args)


def use_fused_wgrad(model: nn.Module) -> list[nn.Module]:
    """Route the fused layers' weight gradients into FSDP2's unsharded gradients.

    Call it once after ``fully_shard`` has been applied (to the blocks and the root) and
    before the first forward. Every ``offload.nn.Linear`` / ``offload.nn.GroupedLinear``
    built with ``fuse_wgrad_accumulation=True`` whose weights FSDP2 manages then writes dW
    (in FSDP's reduce dtype, e.g. fp32 under a bf16/fp32 ``MixedPrecisionPolicy``) into
    the gradient FSDP reduce-scatters: beta = 0 into a fresh buffer when none is pending
    (FSDP reduce-scatters it after this backward and frees it), beta = 1 into the pending
    one when gradient sync was disabled (``set_requires_gradient_sync(False)``) for the
    earlier micro-batches. No ``main_grad`` is needed and none persists. The module
    docstring explains the mechanism. Layers built without fusion are left as they are;
    a fused layer whose weight FSDP does not manage keeps using ``main_grad``. Calling it
    again is harmless.

    Args:
        model: the model after ``fully_shard``.

    Returns:
        The fused layers that now write into FSDP's gradients.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: no submodule of ``model`` is managed by ``fully_shard`` (call it
            first), or no fused layer's weight is managed by it (build the layers with
            ``fuse_wgrad_accumulation=True``).
        NotImplementedError: a fused weight is a DTensor after unsharding (FSDP2 combined
            with tensor parallelism is not supported).
        RuntimeError: the installed torch's FSDP2 lacks the internals this relies on
            (``FSDPParam.unsharded_accumulated_grad``, ``FSDPParamGroup.post_backward``).

    Example:
        >>> # in each of N processes, after torch.distributed.init_process_group(...)
        >>> from torch.distributed.fsdp import fully_shard  # doctest: +SKIP
        >>> for block in model.blocks:                     # doctest: +SKIP
        ...     fully_shard(block)
        >>> fully_shard(model)                             # doctest: +SKIP
        >>> offload.integrations.fsdp.use_fused_wgrad(model)  # doctest: +SKIP
        >>> model.set_requires_gradient_sync(False)  # doctest: +SKIP
        >>> model(x1).sum().backward()  # micro-batch 1 accumulates  # doctest: +SKIP
        >>> model.set_requires_gradient_sync(True)  # doctest: +SKIP
        >>> model(x2).sum().backward()  # micro-batch 2 reduce-scatters  # doctest: +SKIP
        >>> optimizer.step()  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            "offload.integrations.fsdp.use_fused_wgrad(model=...) must be a torch.nn.Module, "
            f"got {type(model).__name__}"
        )
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError as exc:  # torch built without distributed
        raise RuntimeError(
            "offload.integrations.fsdp.use_fused_wgrad needs torch.distributed.fsdp "
            f"(FSDP2), which this torch ({torch.__version__}) does not provide"
        ) from exc

    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        raise ValueError(
            f"offload.integrations.fsdp.use_fused_wgrad: no submodule of "
            f"{type(model).__name__} is managed by fully_shard; call "
            "torch.distributed.fsdp.fully_shard on the blocks and the root first"
        )
    routed: dict[int, nn.Module] = {}
    for fsdp_module in fsdp_modules:
        for group in _param_groups(fsdp_module._get_fsdp_state()):
            has_fused = False
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                pairs = [(info.module, info.param_name)]
                pairs += list(zip(info.shared_modules, info.shared_param_names, strict=True))
                for module, name in pairs:
                    if name not in _fused_weight_names(module):
                        continue
                    if not hasattr(fsdp_param, "unsharded_accumulated_grad"):
                        raise RuntimeError(
                            "offload.integrations.fsdp.use_fused_wgrad: this torch "
                            f"({torch.__version__}) has no FSDPParam.unsharded_accumulated_grad; "
                            "build the layers with fuse_wgrad_accumulation=False under FSDP2 "
                            "with this version"
                        )
                    if getattr(fsdp_param, "is_dtensor", False):
                        raise NotImplementedError(
                            "offload.integrations.fsdp.use_fused_wgrad: the parameter "
                            f"{name!r} of {type(module).__name__} is a DTensor when "
                            "unsharded (FSDP2 with tensor parallelism); fused wgrad does "
                            "not support that, build the layer with "
                            "fuse_wgrad_accumulation=False"
                        )
                    module._fsdp_wgrad[name] = fsdp_param
                    routed[id(module)] = module
                    has_fused = True
            if has_fused and not isinstance(group.post_backward, _PostBackwardUniformDtype):
                original = getattr(group, "post_backward", None)
                if original is None:
                    raise RuntimeError(
                        "offload.integrations.fsdp.use_fused_wgrad: this torch "
                        f"({torch.__version__}) has no FSDPParamGroup.post_backward"
                    )
                group.post_backward = _PostBackwardUniformDtype(group, original)
    if not routed:
        raise ValueError(
            "offload.integrations.fsdp.use_fused_wgrad: found "
            f"{len(fsdp_modules)} fully_shard module(s) but no offload.nn.Linear / "
            "GroupedLinear with fuse_wgrad_accumulation=True among the modules whose "
            "parameters they manage; build the layers with fuse_wgrad_accumulation=True"
        )
    return [m for m in model.modules() if id(m) in routed]
