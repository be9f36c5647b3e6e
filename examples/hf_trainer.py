"""adahop in the Hugging Face Trainer: convert a transformers Llama, train it with ``Trainer``, reload it.

    python examples/hf_trainer.py                    # about 10 s on a CPU, imports included
    python examples/hf_trainer.py --family qwen2 --steps 40 --no-bf16

Needs ``pip install "adahop[hf]"`` (transformers, accelerate). The model is a tiny random
``LlamaForCausalLM`` (or ``Qwen2ForCausalLM``) built from a config, with no download; the text is
the source of a few CPython standard-library modules, byte-level. The steps: convert the model
before the ``Trainer`` is built (before accelerate's ``prepare()``), pass
``adahop.hf_trainer.AdaHOPCallback(recipe.schedule)``, train (the layers calibrate in the
Trainer's first forwards and backwards, gradient accumulation and bf16 on, then the recipe's BF16
phase), and load the last checkpoint back with its modes (``adahop.hf.from_pretrained``).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import tempfile

import torch
import transformers

import adahop
from adahop.hf import from_pretrained
from adahop.hf_trainer import AdaHOPCallback

FAMILIES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}


def byte_tokens() -> torch.Tensor:
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in ("argparse", "textwrap"))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


class Chunks(torch.utils.data.Dataset):
    """Consecutive ``seq_len``-token chunks of ``tokens``, each its own labels (the model shifts them)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.chunks = tokens[: tokens.numel() // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.chunks[i], "labels": self.chunks[i]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=list(FAMILIES), default="llama", help="the transformers model class")
    p.add_argument("--recipe", default="adahop_lv2_tail", help="an adahop recipe (adahop.recipe)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--calibration-steps", type=int, default=4, help="backward passes that calibrate the layers")
    p.add_argument("--grad-accum", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--no-bf16", action="store_true", help="float32 in place of bf16 autocast")
    p.add_argument("--out", default=None, help="the Trainer's output_dir (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.calibration_steps < 1 or args.grad_accum < 1:
        p.error("--steps, --calibration-steps and --grad-accum must be >= 1")
    try:
        recipe = adahop.recipe(args.recipe, calibration_steps=args.calibration_steps, backend="reference")
        recipe.check_run(args.steps, args.grad_accum)  # the BF16 phase must begin after the calibration
    except ValueError as e:
        p.error(str(e))
    logging.basicConfig(format="%(message)s")
    logging.getLogger("adahop.hf_trainer").setLevel(logging.INFO)  # the freeze and the phase, once each

    torch.manual_seed(0)
    config_cls, model_cls = FAMILIES[args.family]
    seq_len = 64
    model = model_cls(config_cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len))
    # 1. convert before the Trainer (and so before accelerate's prepare()): every linear but lm_head
    adahop.convert_to_adahop_training(model, config=recipe.config.with_gemm_settings(oe_k=4))

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        training = transformers.TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=4,
            gradient_accumulation_steps=args.grad_accum, learning_rate=3e-3, lr_scheduler_type="constant",
            bf16=not args.no_bf16, use_cpu=not torch.cuda.is_available(), logging_steps=5, save_steps=args.steps,
            report_to=[], disable_tqdm=True, seed=0)
        # 2. the callback: calibration bookkeeping, the recipe's schedule, logs, checkpoints with modes
        callback = AdaHOPCallback(recipe.schedule)
        trainer = transformers.Trainer(model=model, args=training, train_dataset=Chunks(byte_tokens(), seq_len),
                                       callbacks=[callback])
        trainer.train()
        for record in trainer.state.log_history:
            if "loss" in record:
                print(f"step {record['step']:4d}  loss {record['loss']:.4f}  "
                      f"calibrating layers {record['adahop/calibrating_layers']}")
        print(f"calibrated after step {callback.calibrated_at}; BF16 phase from step {callback.switched_at}")
        # 3. the checkpoint loads back converted, with the modes the run ended with
        loaded = from_pretrained(model_cls, f"{out}/checkpoint-{args.steps}")
        same = all(layer.modes == adahop.adahop_layers(model)[name].modes
                   for name, layer in adahop.adahop_layers(loaded).items())
        print(f"checkpoint-{args.steps} reloaded with the same modes: {same}")
        for name, layer in list(adahop.adahop_layers(loaded).items())[:7]:
            print(f"{name:32s} {', '.join(f'{g}={m}' for g, m in layer.modes.items())}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
