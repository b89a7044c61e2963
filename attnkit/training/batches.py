"""Training rows in a fixed, seed-determined order, so that the data position is just a step count.

Row i of the run is `rows[perm_e[i mod n]]` with e = i // n and perm_e a seeded permutation per
epoch: nothing random happens inside the DataLoader. accelerate shards the batches over processes
(process k of W takes every W-th batch of `per_device` rows), so W processes with batch b see the
same rows per optimizer step as one process with batch W·b, and a resume skips `step · accum`
batches with `accelerator.skip_first_batches`.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader, Dataset

from attnkit.data import pack_tokens
from attnkit.needles import NeedlePlanter
from attnkit.errors import AttnkitError


class EpochRows(Dataset):
    """`length` rows drawn epoch by epoch from `rows` [n, seq_len] in a per-epoch seeded order.

    Item i is {"input_ids": [seq_len], "row": its index in `rows`} — the row index keys the teacher cache.
    """

    def __init__(self, rows: torch.Tensor, length: int, seed: int):
        self.rows, self.length, self.seed = rows, length, seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(len(self.rows), generator=gen)
        return self._perms[epoch]

    def __len__(self) -> int:
        return self.length

    def row_index(self, i: int) -> int:
        epoch, j = divmod(i, len(self.rows))
        return int(self._perm(epoch)[j])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.row_index(i)
        return {"input_ids": self.rows[row], "row": torch.tensor(row)}

    def used_rows(self) -> list[int]:
        """Sorted indices of the rows this run reads (all of them once a run passes one epoch)."""
        if self.length >= len(self.rows):
            return list(range(len(self.rows)))
        return sorted(self.row_index(i) for i in range(self.length))


def plan_steps(data, train, world_size: int) -> tuple[int, int]:
    """(optimizer steps, rows per optimizer step) from the token budget or max_steps."""
    rows_per_step = train.per_device_batch_size * world_size * train.grad_accum
    if train.max_steps is not None:
        return train.max_steps, rows_per_step
    steps = data.tokens // (data.seq_len * rows_per_step)
    if steps < 1:
        raise AttnkitError(
            f"recipe key data.tokens: {data.tokens} tokens is less than one optimizer step "
            f"({rows_per_step} rows × {data.seq_len} tokens)"
        )
    return steps, rows_per_step


def load_train_rows(tokenizer, data, rows_needed: int) -> torch.Tensor:
    """Pack the training split, with needles planted when the recipe asks for them."""
    return pack_tokens(tokenizer, data.source, "train", data.seq_len, rows_needed * data.seq_len, data.seed,
                       transform=needle_planter(tokenizer, data))


def needle_planter(tokenizer, data) -> NeedlePlanter | None:
    if not data.needles.spacing:
        return None

    def count(lines: list[str]) -> list[int]:
        return [len(ids) for ids in tokenizer([line + "\n" for line in lines], add_special_tokens=False)["input_ids"]]

    return NeedlePlanter(count, tuple(data.needles.spacing), tuple(data.needles.distance), seed=data.seed)


def check_enough(rows: torch.Tensor, rows_per_step: int, source: str) -> None:
    if len(rows) < rows_per_step:
        raise AttnkitError(
            f"dataset {source!r} gives {len(rows)} training rows, fewer than one batch "
            f"({rows_per_step} rows = per-device batch × processes × grad_accum)"
        )


def even_validation_rows(rows: torch.Tensor, world: int) -> torch.Tensor:
    """The held-out rows [n, L] cut or tiled to a multiple of the process count, so that every process runs
    the same number of forwards (DDP and FSDP forwards are collectives: one process with a forward more than
    another waits forever). n ≥ W: the last n mod W rows are dropped. 0 < n < W: the whole set is repeated
    W / gcd(n, W) times, so each row is counted equally often and the mean loss is the one of the n rows.
    """
    if len(rows) == 0:
        raise AttnkitError("the validation split gives no row of data.seq_len tokens; lower data.seq_len")
    if len(rows) >= world:
        return rows[: len(rows) // world * world]
    return rows.repeat(world // math.gcd(len(rows), world), 1)  # [n·k, L], n·k a multiple of W


def train_loader(dataset: EpochRows, per_device: int) -> DataLoader:
    """Plain sequential DataLoader; hand it to `accelerator.prepare` to shard it."""
    return DataLoader(dataset, batch_size=per_device, shuffle=False, drop_last=True)
