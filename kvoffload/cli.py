"""The ``kvoffload`` command: one entry point, one subcommand per job.

Subcommands import their packages lazily, so ``kvoffload --help`` is instant and a missing
optional package only affects the subcommand that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Callable

# bench name -> "module:function"; each function takes keyword parameters and returns a dict.
BENCHES: dict[str, str] = {
    "hotcache": "kvcore.bench.hotcache:run",
    "gather": "kvcore.bench.gather:run",
}


def _load(target: str) -> Callable[..., dict]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _cmd_bench(args: argparse.Namespace) -> int:
    run = _load(BENCHES[args.name])
    if not args.json:
        print(f"kvoffload bench {args.name}: running (ratios are measured side by side in this run)...", file=sys.stderr)
    result = run()
    print(json.dumps(result, indent=None if args.json else 2, sort_keys=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvoffload", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = sub.add_parser("bench", help="run a benchmark and print its JSON (ratios measured in one run)")
    bench.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    bench.add_argument("--json", action="store_true", help="print one line of JSON only")
    bench.set_defaults(func=_cmd_bench)
    return parser


def _version() -> str:
    from kvoffload import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
