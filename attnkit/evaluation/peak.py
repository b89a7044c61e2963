"""Peak resident memory of one `attnkit` command, measured in its own process.

`getrusage(RUSAGE_CHILDREN)` is not usable for this: Python starts children with vfork, and at
exec Linux folds the parent's high-water mark into the child's `ru_maxrss`, so a parent that
once held more memory than the child (e.g. it built the test checkpoint) inflates the number.
The child reads its own `VmHWM` (reset at exec) when it exits instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = """
import atexit, sys
def _hwm(path=sys.argv[1]):
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            open(path, "w").write(str(int(line.split()[1]) * 1024))
atexit.register(_hwm)
from attnkit.cli import main
sys.exit(main(sys.argv[2:]))
"""


def run_with_peak(argv: list[str], env: dict | None = None, quiet: bool = True) -> tuple[int, int, str]:
    """Run `attnkit ARGV` in a fresh Python process: (exit code, its peak RSS in bytes, stderr tail)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hwm"
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(out), *argv], env={**os.environ, **(env or {})},
                              stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.PIPE, text=True)
        peak = int(out.read_text()) if out.is_file() else 0
    return proc.returncode, peak, (proc.stderr or "")[-4000:]
