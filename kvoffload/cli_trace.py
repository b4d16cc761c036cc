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
