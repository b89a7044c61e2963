"""Needles: a `name = "value"` line, asked for later as `assert name == "value"`.

The recall tasks (`attnkit.evaluation.tasks.build`) plant one needle in held-out code and ask which of
four values completes the question. Training rows can carry needles too (`data.needles` of a recipe):
then the value after `assert name == "` can only be predicted by finding the needle, so the loss
rewards whatever carries a token across a distance, e.g. a Titans memory past its attention window,
which plain code gives almost no signal for. Training needles use their own names (`TRAIN_NAMES`, never
the evaluation's) and the training split only.
"""

from __future__ import annotations

import heapq
import random
import string
from collections.abc import Callable
from dataclasses import dataclass

VALUE_CHARS = string.ascii_lowercase + string.digits
TRAIN_NAMES = ["acorn", "basil", "cedar", "dune", "eagle", "fjord", "glade", "heron", "iris", "juniper",
               "kelp", "larch", "maple", "nectar", "onyx", "pine", "quartz", "reed", "sage", "tundra"]
NAME_COUNT = len(TRAIN_NAMES) * 90  # name_10 .. name_99


def random_value(rng: random.Random, length: int = 6) -> str:
    return "".join(rng.choice(VALUE_CHARS) for _ in range(length))


def needle_line(name: str, value: str) -> str:
    return f'{name} = "{value}"'


def question(name: str) -> str:
    """The question's text up to the value (the evaluation's context ends here)."""
    return f'assert {name} == "'


@dataclass
class NeedlePlanter:
    """Plants needles into a document's text: one every `spacing` tokens (a uniform draw from the
    inclusive range), each asked `distance` tokens later (drawn the same way), counted with
    `count_tokens` per line, so distances are in the model's own tokens. Needles may overlap (several
    open at once). Seeded once: a fixed document order gives fixed rows."""

    count_tokens: Callable[[list[str]], list[int]]  # lines -> tokens of each line (with its newline)
    spacing: tuple[int, int]
    distance: tuple[int, int]
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def __call__(self, text: str) -> str:
        lines = text.splitlines()
        out: list[str] = []
        open_: list[tuple[int, str, str]] = []  # heap of (position due, name, value)
        pos, next_at = 0, self.rng.randint(*self.spacing)
        for line, size in zip(lines, self.count_tokens(lines) if lines else []):
            while open_ and open_[0][0] <= pos:
                _, name, value = heapq.heappop(open_)
                pos += self._emit(out, question(name) + value + '"')
            if pos >= next_at and len(open_) < NAME_COUNT:  # every name pending: plant the next one later
                name = self._name({n for _, n, _ in open_})
                value = random_value(self.rng)
                pos += self._emit(out, needle_line(name, value))
                heapq.heappush(open_, (pos + self.rng.randint(*self.distance), name, value))
                next_at = pos + self.rng.randint(*self.spacing)
            out.append(line)
            pos += size
        # questions not yet due at the document's end are dropped: their needles stay as plain lines
        return "\n".join(out) + ("\n" if text.endswith("\n") else "")

    def _name(self, taken: set[str]) -> str:
        """A name no open needle has: its question would otherwise follow a reassignment."""
        while (name := f"{self.rng.choice(TRAIN_NAMES)}_{self.rng.randint(10, 99)}") in taken:
            pass
        return name

    def _emit(self, out: list[str], line: str) -> int:
        out.append(line)
        return self.count_tokens([line])[0]
