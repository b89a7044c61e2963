"""`--to titans`'s options (`TitansConfig`): the window, the memory's shape and update chunk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from attnkit.options import option


@dataclass
class TitansConfig:
    GROUP: ClassVar[str | None] = "Titans (--to titans, mla+titans): window attention + neural long-term memory, Memory as Gate"
    window: int = option(128, "tokens the attention still sees (default 128)", metavar="W")
    chunk: int = option(16, "tokens the memory reads per update, <= W (default 16)", metavar="C")
    memory_depth: int = option(2, "layers of the memory MLP (default 2; 0 = the window alone, no memory: the "
                               "baseline)", metavar="N")
    memory_dim: int | None = option(None, "memory key/value size per head (default: head_dim)", metavar="M")
    sparse_slots: int = option(0, "per layer and KV head, the exact keys/values of the S most surprising tokens "
                               "(the memory's loss) that left the window, read by the attention beside it "
                               "(default 0: the window alone)", metavar="S")
    slot_bias: float = option(-1.0, "added to each sparse slot's attention logit (default -1: at 64 slots the "
                              "recipes/reference-recall.yaml model's attnkit-ppl 43.03 against 43.36 at 0, recall "
                              "0.943 against 0.950; docs/titans.md)", metavar="B")
    memory_gate: str = option("open", "open: fine-tuning opens the Memory-as-Gate mix as it anneals; shut: it stays "
                              "shut and the memory only chooses the sparse slots (needs --sparse-slots)",
                              choices=("open", "shut"))
    variant: str = option("mag", "how memory and attention combine: mag = Memory as Gate (mal, Memory as a Layer: not "
                          "implemented, refused)", choices=("mag", "mal"))
