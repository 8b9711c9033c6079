"""Offloading inside CUDA graphs: a whole training step in one graph, and per-layer graphs.

Run:
    python examples/cuda_graphs.py              # a CUDA GPU; on CPU it says why it cannot

1. *Whole step.* Warm up on a side stream (two eager steps under the offloader: with
   ``offload_layers="auto"`` the first measures, the second decides), then capture
   forward and backward in one ``torch.cuda.graph``, entering the offloader inside the
   capture. Replays run the captured copies, waits and reloads with no Python at all.
2. *Per layer.* ``offload.make_graphed_callables`` captures each layer's forward and
   backward as graphs, each offloaded layer's copies inside its own graphs.

For each, it prints the step time of a replay next to the eager step without
offloading, the activation bytes the graph sends to the host, and whether the gradients
of replays on fresh inputs equal the eager step's, bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS

import torch  # noqa: E402

import offload  # noqa: E402
from offload.models import ReferenceModel  # noqa: E402


def grads_of(model: ReferenceModel) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def eager_step(model: ReferenceModel, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model.loss(x).backward()
    return grads_of(model)


def timed(fn, repeats: int = 10) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--replays", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "CUDA graphs need a CUDA device; this machine has none, so there is nothing "
            "to capture. On a GPU this script captures an offloaded training step."
        )
        return
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = ReferenceModel(
        args.layers, args.hidden, 8, 4 * args.hidden, device="cuda", dtype=torch.bfloat16
    )
    reference = copy.deepcopy(model)
    shape = (1, args.seq, args.hidden)
    static_x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    eager_ms = timed(lambda: eager_step(reference, static_x))

    # 1. the whole step in one graph
    off = offload.ActivationOffloader(model.layers, offload_layers=2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with off:
                loss = model.loss(static_x)
            loss.backward()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with off:  # entered inside the capture
            loss = model.loss(static_x)
        loss.backward()
    equal = True
    for _ in range(args.replays):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        static_x.copy_(x)
        graph.replay()
        want = eager_step(reference, x)
        equal &= all(torch.equal(a, b) for a, b in zip(grads_of(model), want))
    stats = off.stats
    print(
        f"whole step: replay {timed(graph.replay):.2f} ms, eager without offloading "
        f"{eager_ms:.2f} ms; {stats.bytes_offloaded / 2**20:.1f} MiB to the host per step "
        f"from {sum(1 for s in stats.layers if s.bytes_offloaded)} layers; "
        f"gradients bitwise equal over {args.replays} replays: {equal}"
    )
    del graph
    off.close()

    # 2. one graph per layer (forward and backward)
    model.zero_grad(set_to_none=True)
    layers = tuple(model.layers)
    off = offload.ActivationOffloader(layers, offload_layers=len(layers) - 1)
    samples = tuple(
        (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True),)
        for _ in layers
    )
    graphed = offload.make_graphed_callables(layers, samples, offloader=off)

    def graphed_step(x: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        h = x.requires_grad_(True)
        for layer in graphed:
            h = layer(h)
        h.float().square().mean().backward()  # ReferenceModel.loss on the output
        return grads_of(model)

    equal = True
    for _ in range(args.replays):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        got = graphed_step(x.clone())
        want = eager_step(reference, x)
        equal &= all(torch.equal(a, b) for a, b in zip(got, want))
    stats = off.stats
    ms = timed(lambda: graphed_step(static_x.clone()))
    print(
        f"per layer: step {ms:.2f} ms, eager without offloading {eager_ms:.2f} ms; "
        f"{stats.bytes_offloaded / 2**20:.1f} MiB to the host per step from "
        f"{sum(1 for s in stats.layers if s.bytes_offloaded)} layers; gradients bitwise "
        f"equal over {args.replays} steps: {equal}"
    )
    off.close()


if __name__ == "__main__":
    main()
