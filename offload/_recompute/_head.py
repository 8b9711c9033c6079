"""The language-model head and its cross-entropy, a slice of the sequence at a time.

A causal LM's last step turns ``tokens x hidden`` states into ``tokens x vocab`` logits,
upcasts them to fp32 and takes the cross-entropy. At 16,384 tokens on a 128,256 vocab
the fp32 logits alone are 8 GiB, and autograd keeps them (or their softmax) until the
backward. :func:`sliced_cross_entropy` computes the same loss over slices of
``slice_tokens`` rows: each slice's logits, their log-sum-exp and, when a backward will
follow, their gradient are made and freed before the next slice (fused linear
cross-entropy: the head's gradients are computed in the forward). What stays for the
backward is the gradient with respect to the hidden states (the size of the hidden
states, which the plain head would have kept anyway) and, only when the head is
trainable, its weight's gradient. The backward scales them by the loss's gradient.

:func:`sliced_head_loss` installs it on a Hugging Face causal LM (PEFT-wrapped or
not): with ``labels`` the loss comes from the slices and the output's ``logits`` is
``None``; without labels the model is unchanged.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from offload._core import _levers

__all__ = ["SlicedHeadHandle", "sliced_cross_entropy", "sliced_head_loss"]

#: ``backend=`` values.
_BACKENDS = ("torch", "liger")
#: ``reduction=`` values (``"none"`` needs the loss's gradient per token before the
#: head's weight gradient can be formed, which a forward-time gradient cannot know).
_REDUCTIONS = ("mean", "sum")
#: Elements of one slice's fp32 logits that ``slice_tokens="auto"`` aims at: 2**27 is
#: 512 MiB per fp32 buffer (a slice holds about two: Note [head slice buffers]).
_AUTO_ELEMENTS = 2**27
_AUTO_MIN, _AUTO_MAX = 256, 8192
#: Config attributes of models whose forward rescales the logits in a way this module
#: does not reproduce (Cohere's ``logit_scale``, Granite's ``logits_scaling``).
_LOGIT_SCALES = ("logit_scale", "logits_scaling")


def auto_slice_tokens(vocab_size: int) -> int:
    """The rows per slice that ``slice_tokens="auto"`` picks for ``vocab_size``.

    A power of two near ``2**27 / vocab_size`` (a 512 MiB fp32 slice of logits), within
    256 to 8192: 4096 for a 32,000 vocab, 1024 for 128,256.

    Args:
        vocab_size: the head's output features.

    Returns:
        The number of rows (tokens) per slice.

    Example:
        >>> auto_slice_tokens(32000), auto_slice_tokens(128256)
        (4096, 1024)
    """
    rows = max(1, _AUTO_ELEMENTS // max(1, int(vocab_size)))
    return max(_AUTO_MIN, min(_AUTO_MAX, 1 << int(math.log2(rows))))


def _check_slice_tokens(slice_tokens: Any) -> None:
    ok = slice_tokens == "auto" or (
        isinstance(slice_tokens, int) and not isinstance(slice_tokens, bool) and slice_tokens > 0
    )
    if not ok:
        raise ValueError(
            f"slice_tokens must be a positive int (rows of logits per slice) or 'auto'; "
            f"got {slice_tokens!r}"
        )


def _check_choice(name: str, value: Any, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(
            f"{name} must be one of {', '.join(repr(a) for a in accepted)}; got {value!r}"
        )


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's where autocast is on (as
    ``F.linear`` would run under it), else the weight's."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


# Note [head slice buffers]
# A slice of ``rows`` tokens holds, at its peak, the logits in the head's dtype, their
# fp32 log-softmax (made from them in one kernel: ``log_softmax(dtype=float32)`` reads
# the low-precision logits, so no fp32 copy of them exists) and the gradient in the
# head's dtype: in bf16 one fp32 buffer and two halves, about two fp32 slices. The
# log-softmax turns into the gradient in place (exp, minus the one-hot, times the
# per-row scale written straight into the low-precision buffer). The per-slice passes
# over the logits are what this costs beyond the two matmuls the plain head also runs.


class _SlicedLinearCrossEntropy(torch.autograd.Function):
    """Loss and gradients slice by slice in the forward; the backward scales them."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        scale: torch.Tensor,
        rows: int,
        softcap: float | None,
        ignore_index: int,
        needs: tuple[bool, bool, bool],
    ) -> torch.Tensor:
        need_x, need_w, need_b = needs
        dtype = _compute_dtype(hidden, weight)
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        n = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_x = torch.empty_like(hidden) if need_x else None
        # fp32 accumulators: the plain head forms these in one matmul (fp32 accumulation
        # inside); summing per-slice results in a lower precision would round per slice.
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        )
        grad_b = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
            if need_b
            else None
        )
        any_grad = need_x or need_w or need_b
        # Autocast is off inside: the dtypes are chosen above, as F.linear under autocast
        # would choose them, and the fp32 softmax must stay fp32.
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, rows):
                x = hidden[start : start + rows].to(dtype)
                t = targets[start : start + rows]
                valid = t != ignore_index
                safe = torch.where(valid, t, 0)
                z = F.linear(x, w, b)
                tanh = None
                if softcap is not None:
                    tanh = z.float().div_(softcap).tanh_()
                    z = tanh * softcap
                # HF upcasts the logits to fp32 and takes log_softmax + nll; dtype= fuses
                # the upcast into the one kernel (no fp32 copy of the logits), and its
                # output becomes the gradient in place below (Note [head slice buffers]).
                logp = torch.log_softmax(z, dim=-1, dtype=torch.float32)
                del z
                picked = logp.gather(1, safe[:, None]).squeeze(1)
                total -= torch.where(valid, picked, 0.0).sum()
                if not any_grad:
                    continue
                # d loss / d z = (softmax(z) - onehot(t)) * scale on the valid rows.
                g = logp.exp_()
                g[torch.arange(g.shape[0], device=g.device), safe] -= 1.0
                weights = (valid.float() * scale)[:, None]
                if tanh is not None:
                    g.mul_(tanh.square_().neg_().add_(1.0))  # d(c tanh(z/c))/dz
                    del tanh
                if dtype == torch.float32:
                    g_low = g.mul_(weights)
                else:  # scaled in fp32 and cast on the way out, where the plain head's
                    # gradient leaves fp32: one pass instead of a multiply and a cast
                    g_low = torch.empty(g.shape, dtype=dtype, device=g.device)
                    torch.mul(g, weights, out=g_low)
                del g, logp
                if grad_x is not None:
                    grad_x[start : start + rows] = g_low @ w
                if grad_w is not None:
                    if dtype == torch.float32:
                        grad_w.addmm_(g_low.t(), x)
                    else:
                        grad_w += (g_low.t() @ x).float()
                if grad_b is not None:
                    grad_b += g_low.float().sum(0)
                del g_low
        # Saved, not kept on ctx: autograd frees saved tensors once the backward has
        # used them, while ctx's attributes live as long as the graph (the loss tensor):
        # held there, they would stay through the whole backward of the model.
        ctx.save_for_backward(
            grad_x,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),  # type: ignore[union-attr]
        )
        return total * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        grad_x, grad_w, grad_b = ctx.saved_tensors

        def scaled(g: torch.Tensor | None) -> torch.Tensor | None:
            return None if g is None else g * grad_out.to(g.dtype)

        return scaled(grad_x), scaled(grad_w), scaled(grad_b), None, None, None, None, None, None


@functools.cache
def _takes_accum_dtype(loss_class: type) -> bool:
    """Whether Liger's loss class takes ``accum_dtype`` (read once, not every step)."""
    return "accum_dtype" in inspect.signature(loss_class).parameters


def _liger_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    ignore_index: int,
    softcap: float | None,
) -> torch.Tensor:
    """Liger-Kernel's fused linear cross-entropy, summed (the caller divides)."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise ImportError(
            "backend='liger' needs the liger-kernel package (pip install liger-kernel); "
            "backend='torch' (the default) needs nothing"
        )
    from liger_kernel.transformers.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyLoss,
    )

    kwargs: dict[str, Any] = {"ignore_index": ignore_index, "reduction": "sum"}
    if softcap is not None:
        kwargs["softcap"] = softcap
    if _takes_accum_dtype(LigerFusedLinearCrossEntropyLoss):
        # Its default sums the head's weight gradient over its chunks in the weight's
        # dtype (bf16: rounded once per chunk, 2.5 % of the largest gradient off on the
        # CUDA test's head); fp32, as the torch backend and the plain head's one matmul.
        kwargs["accum_dtype"] = torch.float32
    loss = LigerFusedLinearCrossEntropyLoss(**kwargs)(weight, hidden, targets, bias)
    return loss[0] if isinstance(loss, tuple) else loss  # some versions add a z-loss


def sliced_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    slice_tokens: int | str = "auto",
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | float | torch.Tensor | None = None,
    shift: bool = False,
    softcap: float | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """``cross_entropy(F.linear(hidden, weight, bias).float(), labels)`` without ever
    holding all the logits.

    The rows of ``hidden`` (every dimension but the last flattened) are taken
    ``slice_tokens`` at a time: their logits in the head's dtype (autocast's where
    autocast is on), upcast to fp32 as Hugging Face does, optionally soft-capped
    (``softcap * tanh(z / softcap)``), then their log-softmax and the target's entry. When
    a backward will follow (grad mode on and ``hidden``, ``weight`` or ``bias`` requiring
    grad), the slice's gradients are formed in the same pass: the logits' gradient in
    fp32, cast to the head's dtype (where the plain head's gradient leaves fp32), times
    the weight for ``hidden``, and summed in fp32 over slices for ``weight`` and
    ``bias`` when they require grad. The backward multiplies them by the loss's gradient.

    Peak memory: one slice's fp32 logits about twice over, instead of all of them;
    kept for the backward: the gradient of ``hidden`` (its size) and the weight's and
    bias's gradients when they require grad. Equal to the plain computation up to float
    summation order (the tests hold it to rtol 1e-5 in fp32, and to 2 % of the largest
    gradient in bf16). Not twice differentiable.

    Args:
        hidden: the head's input, ``(..., hidden)``.
        weight: the head's weight, ``(vocab, hidden)``.
        labels: target ids, ``hidden.shape[:-1]``; ``ignore_index`` marks rows that do
            not count.
        bias: the head's bias, ``(vocab,)``, or ``None``.
        slice_tokens: rows per slice, a positive int, or ``"auto"`` (a 512 MiB fp32
            slice of logits: :func:`auto_slice_tokens`).
        ignore_index: the label of rows left out of the loss (Hugging Face's -100).
        reduction: ``"mean"`` (over the rows not ignored) or ``"sum"``.
        num_items_in_batch: when given, the loss is the sum divided by it (what Hugging
            Face's ``Trainer`` passes under gradient accumulation); ``reduction`` is then
            not used. An int, a float or a tensor.
        shift: ``True`` for a causal LM's labels: the label of row ``i`` is
            ``labels[..., i + 1]`` and the last row of each sequence is ignored (what
            Hugging Face's ``ForCausalLMLoss`` does).
        softcap: ``softcap * tanh(logits / softcap)`` before the loss (Gemma 2's
            ``final_logit_softcapping``), or ``None``.
        backend: ``"torch"`` (pure PyTorch, any device) or ``"liger"`` (Liger-Kernel's
            Triton kernel; needs ``liger-kernel`` and a CUDA device).

    Returns:
        The loss, a 0-dim fp32 tensor.

    Raises:
        ValueError: ``slice_tokens``, ``reduction`` or ``backend`` is not one of the
            accepted values; ``softcap`` is not positive; the shapes do not match.
        ImportError: ``backend="liger"`` without ``liger-kernel`` installed.

    Example:
        >>> import torch, offload
        >>> h = torch.randn(2, 10, 16, requires_grad=True)
        >>> w = torch.randn(50, 16, requires_grad=True)
        >>> y = torch.randint(0, 50, (2, 10))
        >>> loss = offload.sliced_cross_entropy(h, w, y, slice_tokens=4)
        >>> plain = torch.nn.functional.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten())
        >>> torch.allclose(loss, plain)
        True
        >>> loss.backward()
    """
    _check_slice_tokens(slice_tokens)
    _check_choice("reduction", reduction, _REDUCTIONS)
    _check_choice("backend", backend, _BACKENDS)
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"softcap must be a positive number or None; got {softcap!r}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden (..., {weight.shape[-1] if weight.dim() else '?'}) and weight "
            f"(vocab, hidden) do not match: hidden {tuple(hidden.shape)}, weight "
            f"{tuple(weight.shape)}"
        )
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels must have hidden's shape without its last dimension, "
            f"{tuple(hidden.shape[:-1])}; got {tuple(labels.shape)}"
        )
    if shift:
        # Row i predicts token i + 1; the last row of each sequence has nothing to predict.
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = labels.reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if num_items_in_batch is not None:
        denominator = torch.as_tensor(num_items_in_batch, device=hidden.device)
    elif reduction == "mean":
        denominator = (targets != ignore_index).sum()
    else:
        denominator = torch.ones((), device=hidden.device)
    scale = 1.0 / denominator.to(torch.float32)
    if backend == "liger":
        return _liger_loss(flat, weight, bias, targets, ignore_index, softcap).float() * scale
    rows = auto_slice_tokens(weight.shape[0]) if slice_tokens == "auto" else int(slice_tokens)
    grad = torch.is_grad_enabled()
    needs = (
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
        grad and bias is not None and bias.requires_grad,
    )
    return _SlicedLinearCrossEntropy.apply(
        flat, weight, bias, targets, scale, rows, softcap, ignore_index, needs
    )


class SlicedHeadHandle:
    """What :func:`sliced_head_loss` returns.

    ``remove()`` restores the causal LM's ``forward``, its head's ``forward`` and its
    ``loss_function`` (idempotent; also the end of a ``with`` block). Attributes:

    Attributes:
        model: the ``*ForCausalLM`` module changed (inside a PEFT wrapper, the wrapped
            one); ``None`` once collected.
        slice_tokens: rows per slice (``"auto"`` or an int).
        backend: ``"torch"`` or ``"liger"``.
        softcap: the logit soft-cap applied (the config's ``final_logit_softcapping``).
        calls: how many forward calls computed their loss in slices.
        removed: whether :meth:`remove` ran.
    """

    def __init__(
        self, causal: nn.Module, head: nn.Linear, slice_tokens: Any, backend: str, softcap: Any
    ) -> None:
        self._causal = weakref.ref(causal)
        self._head = head
        self.slice_tokens = slice_tokens
        self.backend = backend
        self.softcap = softcap
        self.calls = 0
        self.removed = False
        self._armed = False  # inside a forward call that was given labels
        self._hidden: list[torch.Tensor] = []  # what the head received in that call
        self._loss_done = False
        self._had_loss_function = "_loss_function" in causal.__dict__
        self._old_loss_function = causal.__dict__.get("_loss_function")
        self._old_forward = causal.__dict__.get("forward")
        self._old_head_forward = head.__dict__.get("forward")
        self._ours: dict[str, Any] = {}

    @property
    def model(self) -> nn.Module | None:
        """The causal LM (``None`` once it was garbage collected)."""
        return self._causal()

    # ---- the three replacements ----------------------------------------------------

    def _install(self, causal: nn.Module, original_loss: Any) -> None:
        head = self._head
        head_forward = head.forward
        causal_forward = causal.forward
        bind = inspect.signature(causal_forward).bind_partial

        @functools.wraps(head_forward)
        def sliced_head_forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self._armed:
                return head_forward(hidden, *args, **kwargs)
            self._hidden.append(hidden)
            # A 0-wide stand-in for the logits: whatever the model does to its logits
            # before the loss (a soft-cap's divide, tanh, multiply) runs on no data.
            return hidden.new_empty((*hidden.shape[:-1], 0))

        def sliced_loss(
            logits: Any,
            labels: torch.Tensor,
            vocab_size: int | None = None,
            num_items_in_batch: Any = None,
            ignore_index: int = -100,
            shift_labels: torch.Tensor | None = None,
            **kwargs: Any,
        ) -> torch.Tensor:
            if not (self._armed and self._hidden):  # called with real logits: as before
                return original_loss(
                    logits, labels, vocab_size, num_items_in_batch, ignore_index,
                    shift_labels, **kwargs,
                )  # fmt: skip
            hidden = self._hidden.pop()
            self._loss_done = True
            return sliced_cross_entropy(
                hidden,
                head.weight,
                labels if shift_labels is None else shift_labels,
                head.bias,
                slice_tokens=self.slice_tokens,
                ignore_index=ignore_index,
                num_items_in_batch=num_items_in_batch,
                shift=shift_labels is None,
                softcap=self.softcap,
                backend=self.backend,
            )

        @functools.wraps(causal_forward)
        def sliced_forward(*args: Any, **kwargs: Any) -> Any:
            try:
                labels = bind(*args, **kwargs).arguments.get("labels")
            except TypeError:
                labels = kwargs.get("labels")
            if labels is None or self._armed:
                return causal_forward(*args, **kwargs)
            self._armed, self._loss_done = True, False
            try:
                out = causal_forward(*args, **kwargs)
            finally:
                self._armed = False
                self._hidden.clear()
            if not self._loss_done:
                raise RuntimeError(
                    f"{type(causal).__name__}.forward got labels but did not pass the "
                    f"head's output to self.loss_function; sliced_head_loss supports "
                    f"models whose forward computes logits = lm_head(hidden) and "
                    f"loss = self.loss_function(logits, labels, ...)"
                )
            self.calls += 1
            if isinstance(out, dict) and "logits" in out:
                # The stand-in must not reach the user: the logits were never formed.
                fields = {k: v for k, v in out.items() if k != "logits"}
                out = type(out)(**fields)
            return out

        sliced_forward._offload_sliced_head = True  # type: ignore[attr-defined]
        head.forward = sliced_head_forward
        causal.forward = sliced_forward
        causal.loss_function = sliced_loss
        self._ours = {"head": sliced_head_forward, "forward": sliced_forward, "loss": sliced_loss}
        _levers.register_head(causal)  # "auto" reads it (Note [memory short])

    def remove(self) -> None:
        """Put the model back as it was (every replacement that is still ours)."""
        if self.removed:
            return
        self.removed = True
        causal, head = self._causal(), self._head
        if causal is not None:
            _levers.unregister_head(causal)
        if head.__dict__.get("forward") is self._ours.get("head"):
            _restore(head, "forward", self._old_head_forward)
        if causal is not None:
            if causal.__dict__.get("forward") is self._ours.get("forward"):
                _restore(causal, "forward", self._old_forward)
            if causal.__dict__.get("_loss_function") is self._ours.get("loss"):
                if self._had_loss_function:
                    causal._loss_function = self._old_loss_function
                else:
                    del causal._loss_function
        self._ours.clear()

    def __enter__(self) -> SlicedHeadHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        causal = self.model
        name = "<collected>" if causal is None else type(causal).__name__
        state = "removed" if self.removed else f"slice_tokens={self.slice_tokens!r}"
        return f"SlicedHeadHandle({name}, {state}, backend={self.backend!r})"


def _restore(module: nn.Module, name: str, old: Any) -> None:
    if old is None:
        delattr(module, name)  # the class's method shows through again
    else:
        setattr(module, name, old)


def _find_causal_lm(model: nn.Module) -> nn.Module:
    """The outermost Hugging Face model in ``model`` (itself, or inside a PEFT wrapper)
    that has a linear output head and a ``loss_function``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module; got {type(model).__name__}")
    for module in model.modules():
        get_head = getattr(module, "get_output_embeddings", None)
        if callable(get_head) and hasattr(type(module), "loss_function"):
            if get_head() is not None:
                return module
    raise TypeError(
        f"no Hugging Face causal LM (a module with get_output_embeddings() and "
        f"loss_function, such as LlamaForCausalLM) in {type(model).__name__}; for your own "
        f"model call offload.sliced_cross_entropy(hidden, head.weight, labels)"
    )


def sliced_head_loss(
    model: nn.Module, *, slice_tokens: int | str = "auto", backend: str = "torch"
) -> SlicedHeadHandle:
    """Compute a Hugging Face causal LM's head and loss in slices of the sequence.

    Finds the ``*ForCausalLM`` module (``model`` itself, or the one inside a PEFT
    ``PeftModel``) and changes three things on that instance: its ``forward``, when
    called with ``labels``, makes the head (``get_output_embeddings()``, an
    ``nn.Linear``) hand back a 0-wide stand-in instead of the logits and its
    ``loss_function`` compute :func:`sliced_cross_entropy` on the hidden states the head
    received, with Hugging Face's semantics: labels shifted inside (or ``shift_labels``
    as given), ``ignore_index``, the mean over the tokens not ignored or the sum over
    ``num_items_in_batch`` (what ``Trainer`` passes under gradient accumulation), the
    logits upcast to fp32, the config's ``final_logit_softcapping``. The output's
    ``logits`` is then ``None`` (with ``return_dict=False`` the tuple holds the 0-wide
    stand-in). Without ``labels`` (generation, evaluation of logits) nothing changes.

    Composes with :class:`offload.ActivationOffloader`, with
    :func:`offload.integrations.hf.offload_checkpointing` and with :func:`tile_mlp`: the
    head runs outside the decoder layers they act on.

    Args:
        model: a Hugging Face ``PreTrainedModel`` with a causal LM head, or a PEFT model
            wrapping one.
        slice_tokens: tokens per slice, a positive int, or ``"auto"``
            (:func:`auto_slice_tokens` of the vocabulary: 4096 at 32,000, 1024 at
            128,256).
        backend: ``"torch"`` (default, pure PyTorch) or ``"liger"`` (Liger-Kernel's
            fused kernel; needs ``liger-kernel`` and CUDA).

    Returns:
        A :class:`SlicedHeadHandle`; ``handle.remove()`` restores the model.

    Raises:
        TypeError: no causal LM with ``get_output_embeddings()`` in ``model``; its head is
            not an ``nn.Linear`` (a LoRA-adapted or quantized head).
        ValueError: ``slice_tokens`` or ``backend`` is not an accepted value; the model
            has its own loss (not transformers' ``ForCausalLMLoss``) or rescales its
            logits (``logit_scale``, ``logits_scaling``); the handle is already installed.
        ImportError: ``backend="liger"`` without ``liger-kernel``.

    Example:
        >>> import torch, offload
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                      num_attention_heads=2, vocab_size=100)
        >>> model = LlamaForCausalLM(config)
        >>> handle = offload.sliced_head_loss(model, slice_tokens=8)
        >>> ids = torch.randint(0, 100, (1, 20))
        >>> out = model(ids, labels=ids)
        >>> out.logits is None, out.loss.dim()
        (True, 0)
        >>> out.loss.backward()
        >>> handle.remove()
    """
    _check_slice_tokens(slice_tokens)
    _check_choice("backend", backend, _BACKENDS)
    if backend == "liger" and importlib.util.find_spec("liger_kernel") is None:
        raise ImportError(
            "backend='liger' needs the liger-kernel package (pip install liger-kernel)"
        )
    causal = _find_causal_lm(model)
    head = causal.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"{type(causal).__name__}'s head is a {type(head).__name__}, not an nn.Linear "
            f"(a LoRA-adapted, quantized or custom head): its logits cannot be recomputed "
            f"from head.weight; leave the head out of the adapters"
        )
    if getattr(causal.__dict__.get("forward"), "_offload_sliced_head", False):
        raise ValueError(
            f"{type(causal).__name__} already has sliced_head_loss installed; remove() its "
            f"handle first"
        )
    config: Any = getattr(causal, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _LOGIT_SCALES:
        value = getattr(text_config, name, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"{type(causal).__name__} rescales its logits ({name}={value!r}); "
                f"sliced_head_loss does not reproduce that"
            )
    original_loss = causal.loss_function
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # pragma: no cover - transformers < 4.46
        ForCausalLMLoss = None  # noqa: N806
    if ForCausalLMLoss is not None and original_loss is not ForCausalLMLoss:
        raise ValueError(
            f"{type(causal).__name__}.loss_function is {getattr(original_loss, '__name__', original_loss)!r}, "
            f"not transformers' ForCausalLMLoss: sliced_head_loss reproduces only that loss"
        )
    softcap = getattr(text_config, "final_logit_softcapping", None)
    handle = SlicedHeadHandle(causal, head, slice_tokens, backend, softcap)
    handle._install(causal, original_loss)
    return handle
