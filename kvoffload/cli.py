"""The ``kvoffload`` command: one entry point, one subcommand per job.

Subcommands import their packages lazily, so ``kvoffload --help`` is instant and a missing
optional package only affects the subcommand that needs it. This module puts the parser together
and dispatches; each subcommand group adds its own flags (``add_parser``) and runs in its own module
(``cli_bench``, ``cli_model``, ``cli_trace``, ``cli_plan``, ``cli_stack``).
"""

from __future__ import annotations

import argparse
import sys

from kvoffload import cli_bench, cli_model, cli_plan, cli_stack, cli_trace


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvoffload", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (cli_bench.add_parser, cli_model.add_parser, cli_trace.add_parser, cli_plan.add_parser):
        add(sub)
    cli_stack.add_parsers(sub)  # up, demo
    return parser


def _version() -> str:
    from kvoffload import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    from poolbackends.mooncake_master import MooncakeNotInstalled
    from svcruntime.tls import TLSConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TLSConfigError as exc:
        print(f"kvoffload: {exc}", file=sys.stderr)
        return 2
    except MooncakeNotInstalled as exc:  # --pool mooncake without the wheel: says what to install
        print(f"kvoffload: --pool mooncake: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
