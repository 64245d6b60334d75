"""The ``relibra`` command: ``relibra {demo,trace,plan,score,simulate,compare} ...`` (``relibra -h`` lists them)."""

from __future__ import annotations

import argparse
import importlib
import sys

from .commands import COMMAND_MODULES
from .errors import RelibraError


def build_parser() -> argparse.ArgumentParser:
    """The ``relibra`` parser with every command group of ``commands.COMMAND_MODULES`` that imports."""
    parser = argparse.ArgumentParser(
        prog="relibra",
        description="Routing-replay load balancing for MoE training in RL: traces, plans, simulation, demo.",
        epilog="Run 'relibra COMMAND -h' for the options of a command; 'relibra demo' runs the main job.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # command group not part of this build
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``relibra`` with ``argv`` (default ``sys.argv[1:]``).

    Returns the exit status: 0 on success, 1 on a ``RelibraError`` (printed as ``relibra CMD: error: ...``
    on stderr), 2 without a command; argparse exits with 2 on bad arguments.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except RelibraError as exc:
        print(f"relibra {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
