"""``kvoffload plan``: size a deployment (buffer plan, device and host bytes) and validate its configs."""

from __future__ import annotations

import argparse
import json
import sys


def cmd_plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dsamodel.served import read_config
    from kvoffload.plan_sizing import Deployment, format_report, plan_report

    model = Path(args.model)
    try:  # a DSA model's config.json, or a Llama directory (its indexer, when built, beside the weights)
        config = read_config(model.parent if model.is_file() else model)
    except (OSError, ValueError) as exc:
        print(f"kvoffload plan: cannot read the model config: {exc}", file=sys.stderr)
        return 1
    report = plan_report(
        Deployment(
            config=config,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            prefill_tp=args.prefill_tp,
            decode_tp=args.decode_tp,
            decode_dp=args.decode_dp,
            prefill_kv_transfer_config=args.prefill_kv_transfer_config,
            prefill_additional_config=args.prefill_additional_config,
            decode_kv_transfer_config=args.decode_kv_transfer_config,
            decode_additional_config=args.decode_additional_config,
        )
    )
    print(json.dumps(report) if args.json else format_report(report))
    return 0 if report["valid"] else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``kvoffload plan``'s flags, on the command's subparsers ``sub``."""
    plan = sub.add_parser("plan", help="size a deployment: buffer plan, device and host bytes, config validation")
    plan.add_argument("--model", required=True, help="model directory or config.json (no weights needed)")
    plan.add_argument("--prefill-kv-transfer-config", metavar="JSON", help="the prefill node's --kv-transfer-config")
    plan.add_argument("--prefill-additional-config", metavar="JSON", help="the prefill node's --additional-config")
    plan.add_argument("--decode-kv-transfer-config", metavar="JSON", help="the decode node's --kv-transfer-config")
    plan.add_argument("--decode-additional-config", metavar="JSON", help="the decode node's --additional-config")
    plan.add_argument("--max-model-len", type=int, default=131072)
    plan.add_argument("--max-num-seqs", type=int, default=8)
    plan.add_argument("--block-size", type=int, default=64)
    plan.add_argument("--prefill-tp", type=int, default=1)
    plan.add_argument("--decode-tp", type=int, default=1)
    plan.add_argument("--decode-dp", type=int, default=1)
    plan.add_argument("--json", action="store_true", help="print the report as one line of JSON")
    plan.set_defaults(func=cmd_plan)
