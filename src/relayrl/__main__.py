"""`relayrl` and `python -m relayrl`: answer signals before anything heavy is imported."""

from __future__ import annotations


def main() -> None:
    from relayrl.cli.signals import exit_on_signals

    exit_on_signals()  # a Ctrl-C while typer, pydantic or torch import exits 130 without a traceback
    from relayrl.cli.main import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
