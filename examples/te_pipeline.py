"""TransformerEngine 2.10's manual synchronization: two micro-batches in a 1F1B order.

Run:
    python examples/te_pipeline.py              # CPU: a second; the GPU when present

``get_cpu_offload_context(..., manual_synchronization=True)`` returns a third value, a
synchronizer: nothing is copied, freed or reloaded until the caller says so, per layer
and per forward. Pipeline schedules (1F1B) interleave micro-batches, so the library's
own layer-by-layer schedule does not apply; this script runs forward of micro-batch 0,
forward of micro-batch 1, then both backwards, freeing micro-batch 0's activations as
micro-batch 1 runs, and reloading each just before its backward. It prints what each
layer sent to the host and whether the gradients equal those of the same model without
offloading, bit for bit.
"""

from __future__ import annotations

import argparse
import copy

import torch

import offload
from offload.models import ReferenceModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    # saved tensors of 1 MiB: above get_cpu_offload_context's smallest size to offload
    model = ReferenceModel(args.layers, 256, 4, 704, device=device)
    reference = copy.deepcopy(model)
    inputs = [torch.randn(2, 512, 256, device=device) for _ in range(2)]
    L = args.layers

    # the same two micro-batches without offloading
    for x in inputs:
        reference.loss(x).backward()

    ctx, sync, sched = offload.get_cpu_offload_context(
        True, model_layers=L, manual_synchronization=True
    )
    losses = []
    for mb, x in enumerate(inputs):  # F0 F1
        h = x
        for i, layer in enumerate(model.layers):
            if mb == 1:  # micro-batch 0's layer i is not needed until B0: free it now
                sched.release_activation_forward_gpu_memory(i, forward=0)
            with ctx:
                h = layer(h)
            h = sync(h)
            sched.start_offload_layer(i)
        losses.append(h.float().square().mean())
    for mb in (0, 1):
        sent = [la.bytes_offloaded for la in sched.stats(forward=mb).layers]
        print(f"micro-batch {mb}: bytes sent to the host per layer {sent}")
    for mb in (0, 1):  # B0 B1
        if mb == 1:
            for i in range(L):
                sched.release_activation_forward_gpu_memory(i, forward=1)
        for i in reversed(range(L)):
            sched.start_reload_layer(i, forward=mb)
        losses[mb].backward()

    same = all(
        torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())
    )
    print(f"gradients bitwise equal to no offloading: {same}")


if __name__ == "__main__":
    main()
