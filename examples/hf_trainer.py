"""Activation offloading inside a Hugging Face ``Trainer``: one line, ``offloader.attach(model)``.

The training loop belongs to ``transformers.Trainer``, so there is no forward to wrap in
``with offloader:``. ``offloader.attach(model)`` puts hooks on the model instead: every
forward the Trainer runs with gradients enabled is entered as ``with offloader:`` would,
and the backward (run by the Trainer, outside) reloads what was offloaded. Evaluation
forwards (under ``torch.no_grad``) are left alone.

The model is a tiny Llama built from a random config (hidden 64, vocab 128; nothing is
downloaded), trained with AdamW on a random token dataset of sequences of 32 tokens.

Run (needs ``transformers`` and ``accelerate``: ``pip install -e ".[dev]"``)::

    python examples/hf_trainer.py                      # CPU: a few seconds (GPU if present)
    python examples/hf_trainer.py --steps 8 --layers 2 --device cpu

Prints the loss of each training step (``step N: loss X``), the bytes offloaded by the
last forward (``bytes offloaded in the last step: N``), then ``offloader.report()``:
which decoder layers sent how many bytes to host memory and why the rest stayed.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch
import transformers

import offload


class RandomTokens(torch.utils.data.Dataset):
    """``n`` random sequences; the labels are the inputs (the model shifts them)."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class PrintLoss(transformers.TrainerCallback):
    """Prints ``step N: loss X`` for each logged training step."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            print(f"step {state.global_step - 1}: loss {logs['loss']:.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps (default 4)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config)

    # The one line this example is about (min_tensor_bytes=0: this model's activations
    # are tiny; the default keeps tensors under 256 KiB on the device).
    offloader = offload.ActivationOffloader(offload.find_layers(model), min_tensor_bytes=0)
    offloader.attach(model)

    with tempfile.TemporaryDirectory() as out:
        training_args = transformers.TrainingArguments(
            output_dir=out,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            learning_rate=1e-3,
            logging_steps=1,
            seed=0,
            report_to=[],
            use_cpu=args.device == "cpu",
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = transformers.Trainer(
            model=model,
            args=training_args,
            train_dataset=RandomTokens(args.steps * args.batch, 32, config.vocab_size),
            callbacks=[PrintLoss()],
        )
        trainer.remove_callback(transformers.PrinterCallback)  # PrintLoss prints instead
        trainer.train()

    print(f"bytes offloaded in the last step: {offloader.stats.bytes_offloaded}")
    offloader.report()
    offloader.detach()
    offloader.close()


if __name__ == "__main__":
    main()
