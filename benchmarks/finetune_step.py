"""One optimizer step of plain PEFT LoRA and of full fine-tuning (AdamW) on a checkpoint: how much the
loss on that batch moves. A converted model that anyone can fine-tune moves about as much as its source.

    python benchmarks/finetune_step.py MODEL [MODEL ...]
"""

from __future__ import annotations

import argparse
import copy

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnkit.data import pack_tokens

MLP = {"gate_proj", "up_proj", "down_proj"}


def loss_of(model, batch: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=batch, labels=batch).loss)


def one_step(model, batch: torch.Tensor, lr: float) -> float:
    """Loss on `batch` after one AdamW step on it."""
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    model(input_ids=batch, labels=batch).loss.backward()
    torch.optim.AdamW(params, lr=lr).step()
    model.eval()
    return loss_of(model, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--lr", default="1e-4,1e-3")
    args = parser.parse_args()
    for path in args.models:
        tok = AutoTokenizer.from_pretrained(path)
        batch = pack_tokens(tok, "python", "train", 256, 4 * 256, 1)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        linear = {n.split(".")[-1] for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n}
        l0 = loss_of(base, batch)
        for lr in (float(x) for x in args.lr.split(",")):
            lora = get_peft_model(copy.deepcopy(base), LoraConfig(r=16, lora_alpha=32, target_modules=sorted(linear - MLP)))
            l_lora, l_full = one_step(lora, batch, lr), one_step(copy.deepcopy(base), batch, lr)
            print(f"{path}  lr {lr:g}: loss {l0:.4f} -> LoRA {l_lora:.4f} ({100 * (l_lora / l0 - 1):+.2f} %), "
                  f"full {l_full:.4f} ({100 * (l_full / l0 - 1):+.2f} %)")


if __name__ == "__main__":
    main()
