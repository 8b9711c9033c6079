"""Whether each peer method of ``bench_long_context.py`` can load here: one line per
method, ``ok`` with the package version and how it was loaded, or the error. Imports
each package the way the benchmark's worker does (``import_peer``) and then the names
the method uses; for ``unsloth-zoo`` also installs unsloth_zoo's fused LM-head loss
forward on ``LlamaForCausalLM`` (this process only), which fails on a transformers whose
forward it does not recognise. Always exits 0; takes seconds.

Command (from the repository root; peers carried as wheels, see the benchmark's
docstring)::

    PYTHONPATH=. python3 benchmarks/longctx/check_peers.py
"""

from __future__ import annotations

import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def check(method: str) -> str:
    """Load ``method``'s peer; the line to print."""
    from benchmarks.longctx import bench_long_context as bench

    if method.startswith("unsloth-zoo"):
        os.environ["UNSLOTH_FUSED_FORWARD"] = "0" if method.endswith("nofused") else "1"
    facts = bench.import_peer(method)
    extra = ""
    if method.startswith("trl-offload"):
        from trl.models.activation_offloading import get_act_offloading_ctx_manager  # noqa: F401
    elif method.startswith("deepspeed-ckpt-offload"):
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.activation_checkpointing.offload_activations import (  # noqa: F401
            CheckpointHiddenStatesOffload,
        )

        if method.endswith("-tiled"):
            from deepspeed.runtime.sequence_parallel.ulysses_sp import (  # noqa: F401
                TiledFusedLogitsLoss,
                TiledMLP,
            )
        extra = f"; accelerator {get_accelerator().device_name()}"
    elif method.startswith("unsloth-zoo"):
        from transformers import LlamaForCausalLM
        from unsloth_zoo.fused_losses import forward_install
        from unsloth_zoo.gradient_checkpointing import (  # noqa: F401
            patch_unsloth_smart_gradient_checkpointing,
        )

        if method == "unsloth-zoo":
            fused = bench._unsloth_fused_forward(forward_install, LlamaForCausalLM)
            extra = f"; fused forward on LlamaForCausalLM: {fused['tier']}"
    return f"ok {facts.get('peer_version')} | {facts.get('loaded_as')}{extra}"


def main() -> int:
    import torch
    import transformers

    from benchmarks.longctx import bench_long_context as bench

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"cuda {torch.cuda.is_available()}")  # fmt: skip
    for method in bench.PEER_PACKAGES:
        try:
            line = check(method)
        except Exception as exc:  # every peer gets its line
            where = traceback.extract_tb(exc.__traceback__)[-1]
            line = f"error {type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})"
        print(f"{method:30} {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
