"""`relayrl` and `python -m relayrl`: answer signals before anything heavy is imported."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType


def _exit_early(signum: int, frame: FrameType | None) -> None:
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(128 + signum)  # nothing started yet that must be ended (relayrl.exits has no hooks before a run)


def main() -> None:
    # before even asyncio is imported (it takes a while on a loaded machine): a Ctrl-C exits 130
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_early)
    from relayrl.cli.signals import exit_on_signals

    exit_on_signals()  # a Ctrl-C while typer, pydantic or torch import exits 130 without a traceback
    from relayrl.cli.main import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
