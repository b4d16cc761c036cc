"""``kvoffload bench NAME``: run one benchmark, print its JSON, exit with its verdict.

The benches live in their packages (``BENCHES``: each a function taking keyword parameters and
returning a dict); this module runs one with stdout kept for the JSON alone, records the traces its
default run needs first, and turns the result's goals into the exit status (``BENCH_EXIT_STATUS``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator

from kvcore.pool.registry import STACK_POOLS  # light: names only, no backend is imported
from kvcore.transferregistry import STACK_TRANSFERS

# bench name -> "module:function"; each function takes keyword parameters and returns a dict.
BENCHES: dict[str, str] = {
    "hotcache": "kvoffload_bench.hotcache:run",
    "gather": "kvoffload_bench.gather:run",
    "prefill": "kvoffload_bench.prefill:run",
    "prefix": "kvoffload_bench.prefix:run",
    "decode": "kvoffload_bench.decode:run",
    "pd": "kvoffload_bench.pd:run",
    "load": "kvoffload_bench.load:run",
    "faults": "kvoffload_testing.faults:bench",
    "vllm": "kvoffload_bench.vllm_connectors:run",
    "pool": "kvoffload_bench.pool:run",
    "quality": "kvoffload_bench.quality:run",
}


# bench name -> the recorded traces its default run reads (kvoffload_bench.trace_record records them)
RECORDED_TRACES: dict[str, tuple[str, ...]] = {"hotcache": ("smollm2", "smollm2-indexer")}

# options passed on only to the benches whose run() takes a parameter of that name
BENCH_OPTIONS = ("trace", "pool", "transfer", "plot", "prompts")

# ``kvoffload bench``'s exit statuses (its --help, docs/configuration.md §6.6 and the Makefile's bench
# target say the same)
EXIT_GOALS_MET, EXIT_ERROR, EXIT_USAGE, EXIT_GOALS_NOT_MET = 0, 1, 2, 3
BENCH_EXIT_STATUS = """exit status:
  0  every goal the result judges (goals_met, faults: goal_met) was met
  1  error: the bench failed, or its result judges no goal (no goals_met / goal_met of true/false)
  2  usage error: an unknown bench, an option this bench does not take
  3  goals not met: the bench ran and printed its JSON, but a goal was not met or its figure could
     not be measured; stderr names each one (and why, under the JSON's not_measured)

stdout carries the one JSON document only; logs, progress and the verdict go to stderr."""


def _load(target: str) -> Callable[..., dict]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Points file descriptor 1 at stderr while the block runs: whatever it writes to stdout (prints,
    structlog, a native library's logs, child processes that inherit the descriptor) lands on
    stderr, so stdout keeps only the JSON document printed after the block."""
    import ctypes

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        ctypes.CDLL(None).fflush(None)  # C stdio buffers a native library filled while 1 was stderr
        os.dup2(saved, 1)
        os.close(saved)


def cmd_bench(args: argparse.Namespace) -> int:
    run = _load(BENCHES[args.name])
    kwargs = {}
    for option in BENCH_OPTIONS:
        value = getattr(args, option)
        if value is None:
            continue
        import inspect

        if option not in inspect.signature(run).parameters:
            print(f"kvoffload bench {args.name}: this bench takes no --{option}", file=sys.stderr)
            return EXIT_USAGE
        kwargs[option] = value
    with _stdout_to_stderr():
        result = _run_bench(args, run, kwargs)
    if result is None:
        return EXIT_ERROR
    print(json.dumps(result, indent=None if args.json else 2, sort_keys=False))
    return _bench_verdict(args.name, result)


def _run_bench(args: argparse.Namespace, run: Callable[..., dict], kwargs: dict) -> dict | None:
    """The bench's result; None when the recorded trace it was given is not there (said on stderr)."""
    # recorded traces the run needs are recorded first when missing (minutes, once per machine)
    from kvoffload_bench.trace_record import KNOWN, ensure

    for name in [args.trace] if args.trace else RECORDED_TRACES.get(args.name, ()):
        if name in KNOWN:
            ensure(name, log=lambda line: print(f"kvoffload bench {args.name}: {line}", file=sys.stderr))
    if not args.json:
        print(
            f"kvoffload bench {args.name}: running (ratios are measured side by side in this run)...", file=sys.stderr
        )
    try:
        return run(**kwargs)
    except FileNotFoundError as exc:  # a recorded trace that is not there: its message says how to record it
        if args.trace is None:
            raise
        print(f"kvoffload bench {args.name}: {exc}", file=sys.stderr)
        return None


def _unmet_goals(result: dict) -> list[str]:
    """The goals ``result`` did not meet: the false entries of ``goals_met`` (a dict of true/false)
    and ``goal_met`` when that single verdict is false. ValueError when it judges no goal at all
    or judges one with something other than true/false."""
    if "goals_met" not in result and "goal_met" not in result:
        raise ValueError("its result has neither goals_met nor goal_met: it judges no goal")
    unmet = []
    if "goals_met" in result:
        met = result["goals_met"]
        if not isinstance(met, dict) or not met or not all(isinstance(v, bool) for v in met.values()):
            raise ValueError(f"its goals_met is {met!r}, not a non-empty dict of true/false")
        unmet += [goal for goal, ok in met.items() if not ok]
    if "goal_met" in result:
        if not isinstance(result["goal_met"], bool):
            raise ValueError(f"its goal_met is {result['goal_met']!r}, not true/false")
        unmet += [] if result["goal_met"] else ["goal_met"]
    return unmet


def _bench_verdict(name: str, result: dict) -> int:
    """The exit status of ``kvoffload bench NAME`` for its result (BENCH_EXIT_STATUS), said on stderr."""

    def say(line: str) -> None:
        print(f"kvoffload bench {name}: {line}", file=sys.stderr)

    try:
        unmet = _unmet_goals(result)
    except ValueError as exc:
        say(f"error: {exc}")
        return EXIT_ERROR
    if not unmet:
        say("every goal met")
        return EXIT_GOALS_MET
    why = result.get("not_measured") or {}
    say("goals not met: " + ", ".join(f"{g} (not measured: {why[g]})" if g in why else g for g in unmet))
    return EXIT_GOALS_NOT_MET


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``kvoffload bench``'s flags, on the command's subparsers ``sub``."""
    bench = sub.add_parser(
        "bench",
        help="run a benchmark and print its JSON (ratios measured in one run)",
        description="Run a benchmark and print its result as one JSON document on stdout\n"
        "(ratios measured side by side in one run; its goals as true/false in\n"
        "goals_met).",
        epilog=BENCH_EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    bench.add_argument("--json", action="store_true", help="print the JSON on one line (default: indented)")
    bench.add_argument(
        "--trace",
        metavar="NAME",
        help="run on a top-k trace (a synthetic preset overlap80/90/95 or "
        "a recorded one), for benches that take one (e.g. decode)",
    )
    bench.add_argument(
        "--pool",
        choices=STACK_POOLS,
        help="the prefill's host-pool backend of the stack, for benches that take one (faults; default kvoffload)",
    )
    bench.add_argument(
        "--transfer",
        choices=STACK_TRANSFERS,
        help="the P→D pull's transfer_backend of the stack, for benches that take one (faults; default kvoffload)",
    )
    bench.add_argument(
        "--plot",
        metavar="DIR",
        help="write the bench's curves as PNG files into DIR, for benches that draw them (quality)",
    )
    bench.add_argument(
        "--prompts",
        type=int,
        metavar="N",
        help="documents per context length, for benches that take them (quality; default 16)",
    )
    bench.set_defaults(func=cmd_bench)
