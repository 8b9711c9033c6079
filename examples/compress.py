"""Compressed offload: the same training with ``compress=None`` and ``compress="fp8"``.

Run:
    python examples/compress.py                 # CPU: a few seconds; the GPU when present
    python examples/compress.py --steps 20

``compress="fp8"`` is lossy and opt-in: the bf16/fp16 tensors an offloaded layer saves
travel as float8_e4m3fn with one fp32 scale per 128 elements (about half the link bytes
and host memory) and come back dequantized; fp32 tensors travel exactly unless
``compress_filter`` says otherwise. On the CPU the model is fp32, so this script passes
``compress_filter=lambda t: True`` there (a quarter of the bytes). Two copies
of one model train from the same seed on the same batches, one per setting; the script
prints both losses per step, the bytes before and after compression, and how far the
compressed run's gradients are from the exact ones after the first step.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

import offload
from offload.models import ReferenceModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    exact = ReferenceModel(args.layers, args.hidden, 4, 4 * args.hidden, device=device, dtype=dtype)
    lossy = copy.deepcopy(exact)
    runs = {}
    for name, model, compress in (("exact", exact, None), ("fp8", lossy, "fp8")):
        extra = {}
        if compress is not None and dtype == torch.float32:
            extra["compress_filter"] = lambda t: True  # fp32 travels exactly by default
        offloader = offload.ActivationOffloader(
            model.layers, offload_layers="all", min_tensor_bytes=0, compress=compress, **extra
        )
        runs[name] = (model, offloader, torch.optim.SGD(model.parameters(), lr=0.1))

    gen = torch.Generator(device="cpu").manual_seed(1)
    for step in range(args.steps):
        x = torch.randn(2, args.seq, args.hidden, generator=gen).to(device, dtype)
        target = torch.randn(2, args.seq, args.hidden, generator=gen).to(device, dtype)
        losses = {}
        for name, (model, offloader, opt) in runs.items():
            with offloader:
                y = model(x)
            loss = F.mse_loss(y.float(), target.float())
            loss.backward()
            if step == 0:
                if name == "exact":
                    first = [p.grad.clone() for p in model.parameters()]
                else:
                    cos = min(
                        float(F.cosine_similarity(a.flatten().float(), p.grad.flatten().float(), 0))
                        for a, p in zip(first, model.parameters())
                    )
                    print(f"first step: lowest cosine similarity of a gradient to exact: {cos:.5f}")
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name] = loss.item()
        print(f"step {step}: loss exact {losses['exact']:.5f}  fp8 {losses['fp8']:.5f}")

    stats = runs["fp8"][1].stats
    print(
        f"compressed {stats.compress_bytes_before} bytes to {stats.compress_bytes_after} "
        f"(ratio {stats.compress_bytes_after / stats.compress_bytes_before:.3f}); "
        f"sent exactly: {runs['exact'][1].stats.bytes_offloaded} bytes"
    )
    runs["fp8"][1].report()
    for _, offloader, _ in runs.values():
        offloader.close()


if __name__ == "__main__":
    main()
