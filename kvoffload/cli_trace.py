"""``kvoffload trace record`` / ``kvoffload trace show``: record a real model's top-k trace, print a
trace's locality."""

from __future__ import annotations

import argparse
import json
import sys


def cmd_trace_record(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from tqdm import tqdm

    from kvcore.traces.measure import locality
    from kvcore.traces.trace import Trace, traces_dir
    from kvoffload_bench.trace_record import ensure
    from kvoffload_testing.model_fetch import FetchError

    params = {k: getattr(args, k) for k in ("context", "steps", "topk", "requests") if getattr(args, k) is not None}
    target = Path(args.out) if args.out else traces_dir() / f"{args.name}.pt"
    fresh = args.force or not target.exists()
    start = time.monotonic()
    with tqdm(desc=f"recording {args.name}", unit="step", file=sys.stderr, disable=not fresh) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        try:
            path = ensure(
                args.name,
                path=target,
                force=args.force,
                progress=progress,
                log=lambda line: tqdm.write(f"kvoffload trace record: {line}", file=sys.stderr),
                **params,
            )
        except (ValueError, FetchError) as exc:
            print(f"kvoffload trace record: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, ValueError) else 1
    trace = Trace.load(path)
    if fresh:
        print(
            f"wrote {path} ({trace.streams} streams x {trace.steps} steps x top-{trace.k}) "
            f"in {time.monotonic() - start:.0f} s"
        )
    else:
        print(
            f"{path} already holds trace {args.name} (context {trace.meta.get('context')}, "
            f"steps {trace.steps}, top-{trace.k}); --force records it again"
        )
    print(json.dumps(locality(trace), indent=2))
    return 0


def cmd_trace_show(args: argparse.Namespace) -> int:
    from kvcore.traces import named
    from kvcore.traces.measure import locality

    try:
        trace = named(args.name)
    except (FileNotFoundError, ValueError) as exc:
        print(f"kvoffload trace show: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(locality(trace), indent=2))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``kvoffload trace record|show``'s flags, on the command's subparsers ``sub``."""
    trace = sub.add_parser("trace", help="top-k traces: record one from a real model, show locality").add_subparsers(
        dest="trace_command", required=True, metavar="ACTION"
    )
    rec = trace.add_parser(
        "record",
        help="record a real model's top-k attention trace into the trace cache "
        "($KVOFFLOAD_HOME/traces/NAME.pt) and print its locality",
    )
    rec.add_argument(
        "name",
        help="smollm2: SmolLM2-135M-Instruct's exact attention top-k; smollm2-indexer: the top-k its indexer "
        "selects in sparse decode (the model and its indexer built on first use)",
    )
    rec.add_argument("--context", type=int, help="prompt tokens (default 4096)")
    rec.add_argument("--steps", type=int, help="decode steps recorded (default 128)")
    rec.add_argument(
        "--topk", type=int, help="positions selected per step and stream (default 128; smollm2-indexer: index_topk)"
    )
    rec.add_argument("--requests", type=int, help="prompts, each on a different document (default 2)")
    rec.add_argument("--out", help="write the trace here instead of the cache")
    rec.add_argument("--force", action="store_true", help="record again even when the trace exists")
    rec.set_defaults(func=cmd_trace_record)
    show = trace.add_parser("show", help="print the locality of a named trace (synthetic preset or recorded)")
    show.add_argument("name", help="overlap80, overlap90, overlap95 or a recorded trace's name")
    show.set_defaults(func=cmd_trace_show)
