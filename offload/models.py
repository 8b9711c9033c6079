"""The built-in reference model of ``python -m offload profile`` and of the examples
(``from offload.models import ReferenceModel``): a stack of Llama-style blocks (RMSNorm,
fused QKV, causal SDPA, output projection, RMSNorm, SwiGLU MLP, with residuals; no RoPE,
no embedding, no head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ReferenceBlock", "ReferenceModel"]


class ReferenceBlock(nn.Module):
    """One Llama-style layer: ``x + out(SDPA_causal(qkv(RMSNorm(x))))`` then
    ``x + down(silu(gate) * up)`` with ``gate, up = gate_up(RMSNorm(x))``.

    Args:
        hidden: model width; must be divisible by ``heads``.
        heads: attention heads.
        ffn: width of the SwiGLU MLP.
        device: where the parameters live. Default ``None`` (PyTorch's default device).
        dtype: parameter dtype. Default ``None`` (PyTorch's default dtype).

    Raises:
        ValueError: a size is not positive or ``hidden`` is not divisible by ``heads``.

    Example:
        >>> block = ReferenceBlock(64, 4, 128)
        >>> block(torch.randn(2, 8, 64)).shape
        torch.Size([2, 8, 64])
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        ffn: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("hidden", hidden), ("heads", heads), ("ffn", ffn)):
            if value < 1:
                raise ValueError(f"{name}={value}: must be >= 1")
        if hidden % heads:
            raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
        kw = {"device": device, "dtype": dtype}
        self.heads = heads
        self.attn_norm = nn.RMSNorm(hidden, eps=1e-5, **kw)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False, **kw)
        self.out = nn.Linear(hidden, hidden, bias=False, **kw)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-5, **kw)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False, **kw)
        self.down = nn.Linear(ffn, hidden, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [b, heads, s, head_dim]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class ReferenceModel(nn.Module):
    """``layers`` :class:`ReferenceBlock` applied in order; ``loss(x)`` is the mean of
    squares of the output, computed in fp32.

    Args:
        layers: number of blocks.
        hidden, heads, ffn, device, dtype: as for :class:`ReferenceBlock`.

    Raises:
        ValueError: ``layers`` < 1, or a block's size is invalid.

    Example:
        >>> model = ReferenceModel(2, 64, 4, 128)
        >>> model.loss(torch.randn(1, 8, 64)).ndim
        0
    """

    def __init__(
        self,
        layers: int,
        hidden: int,
        heads: int,
        ffn: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"layers={layers}: must be >= 1")
        self.layers = nn.ModuleList(
            ReferenceBlock(hidden, heads, ffn, device=device, dtype=dtype) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        """Mean of squares of ``self(x)``, in fp32."""
        return self(x).float().square().mean()
