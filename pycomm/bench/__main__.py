"""The `pycomm-bench` command (also `python -m pycomm.bench`). With no subcommand it runs
the default job: an all-reduce sweep on 2 local ranks (Gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import argparse
import sys

from . import clip, collectives, ddp

_COMMANDS = {"collectives": collectives, "ddp": ddp, "clip": clip}


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line naming the argument (exit code 2), not the whole usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line `argv` (without the program name) as the subcommand's namespace;
    exits 2 with a one-line error on bad input."""
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["collectives", *argv]
    parser = _Parser(prog="pycomm-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, mod in _COMMANDS.items():
        mod.add_arguments(sub.add_parser(name, help=mod.__doc__.splitlines()[0]))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse(sys.argv[1:] if argv is None else argv)
    return _COMMANDS[ns.command].main(ns)


if __name__ == "__main__":
    sys.exit(main())
