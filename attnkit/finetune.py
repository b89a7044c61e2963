"""`python -m attnkit.finetune --config RECIPE [key=value ...]`, the module `accelerate launch -m` runs.

Same arguments and behaviour as `attnkit finetune`; every process of a launch parses the same
recipe, so a bad recipe fails on all of them with the same one-line error and exit status 2.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from attnkit.cli import main as cli_main

    return cli_main(["finetune", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
