"""The planner: a lever per layer (keep, offload, selective recompute, checkpoint) for an
activation-memory budget.

Run:
    python examples/planner.py                  # CUDA: measures, plans for half the peak
    python examples/planner.py --budget 0.3
    python examples/planner.py --device cpu     # no CUDA: a plan chosen by hand

On a GPU ``offload.plan`` measures the step without levers and with each lever on every
layer, then picks per layer what meets the budget at the least predicted step time;
the script prints the plan, applies it, and measures the step time and activation peak
it really gets. Without a GPU (the planner measures device time and memory) it applies a
hand-made plan with one layer of each kind and checks that training is unchanged: the
loss after a few SGD steps is bitwise the same with and without the plan.
"""

from __future__ import annotations

import argparse
import copy

import torch

import offload
from offload.models import ReferenceModel


def measure(step, steps: int = 3, warmup: int = 1) -> tuple[float, int]:
    """Median step time (ms, CUDA events) and the largest activation peak (bytes: most
    allocated during a step above what was allocated before it) of ``step``."""
    for _ in range(warmup):
        step()
    times, peaks = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        peaks.append(torch.cuda.max_memory_allocated() - before)
    return sorted(times)[len(times) // 2], max(peaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.5, help="fraction of the peak")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    hidden = args.hidden or (2048 if cuda else 64)
    seq = args.seq or (4096 if cuda else 32)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = ReferenceModel(
        args.layers, hidden, max(1, hidden // 128), 4 * hidden, device=device, dtype=dtype
    )
    x = torch.randn(1, seq, hidden, device=device, dtype=dtype)

    def step() -> None:
        model.loss(x).backward()

    if cuda:
        plan = offload.plan(step, model.layers, budget=args.budget, model=model)
        plan.report()
        before_ms, before_peak = measure(step)
        plan.apply(model)
        after_ms, after_peak = measure(step)
        plan.remove()
        print(
            f"measured: step {before_ms:.1f} -> {after_ms:.1f} ms, activation peak "
            f"{before_peak / 2**30:.2f} -> {after_peak / 2**30:.2f} GiB "
            f"(budget {plan.budget_bytes / 2**30:.2f})"
        )
        return

    levers = ["offload", "checkpoint", "selective"] + ["keep"] * (args.layers - 3)
    plan = offload.Plan(model.layers, levers, min_tensor_bytes=0)
    reference = copy.deepcopy(model)
    losses = {}
    for name, m in (("without", reference), ("with", model)):
        if m is model:
            plan.apply(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for _ in range(args.steps):
            loss = m.loss(x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses[name] = loss.detach()
        print(f"loss after {args.steps} steps {name} the plan ({plan!r}): {loss.item():.6f}")
    plan.report()
    plan.remove()
    print(f"bitwise equal: {torch.equal(losses['with'], losses['without'])}")


if __name__ == "__main__":
    main()
