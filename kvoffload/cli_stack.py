"""``kvoffload up`` / ``kvoffload demo``: the stack on loopback from the command line, on the reference
engine or on vLLM (``--engine``): the flags each engine takes, the ``StackConfig`` they make, the
running stack watched until Ctrl-C, and the demo's one request and summary."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvcore.pool.registry import EMBEDDED, STACK_POOLS
from svcruntime.tls import add_tls_arguments  # light: grpc is imported only when a channel is opened

ENGINES = ("reference", "vllm")
# `up` / `demo` flags only the reference engine takes (argparse dest -> flag), and why not vLLM's
REFERENCE_ONLY = {"tls_cert": "--tls-cert", "tls_key": "--tls-key", "tls_ca": "--tls-ca"}
REFERENCE_ONLY_WHY = (
    "the vLLM connectors do not speak TLS to the metastore yet, and the vLLM stack's prefill keeps its "
    "store on backend 'kvoffload' (a vLLM server of your own also takes 'mooncake': docs/vllm.md)"
)
VLLM_STACK_POOLS = (EMBEDDED,)  # `up --engine vllm --pool`
MODES = ("pd", "offload-only")  # `up --mode` (== stack_config.MODES of kvoffload_testing; --help stays light)
REFERENCE_MAX_MODEL_LEN = 16384
DECODE_MAX_NUM_SEQS = 8  # the stack's decode (kvoffload-decode's default --max-num-seqs)
VLLM_MAX_MODEL_LEN = 4096  # kvoffload_testing.vllm_stack.DEFAULT_MAX_MODEL_LEN (not imported here: --help stays light)


def _check_engine(args: argparse.Namespace) -> None:
    """Refuse (exit 2, with the subcommand's usage) what the chosen engine cannot honour."""
    if args.engine != "vllm":
        return
    given = [flag for dest, flag in REFERENCE_ONLY.items() if getattr(args, dest, None) is not None]
    if getattr(args, "pool", EMBEDDED) not in VLLM_STACK_POOLS:
        given.append(f"--pool {args.pool}")
    if getattr(args, "mode", "pd") != "pd":
        given.append(f"--mode {args.mode}")
    if given:
        args.parser.error(f"{', '.join(given)}: only with --engine reference; {REFERENCE_ONLY_WHY}")
    import importlib.util

    missing = [m for m in ("vllm", "kvoffload_vllm") if importlib.util.find_spec(m) is None]
    if missing:
        args.parser.error(
            f"--engine vllm needs {' and '.join(missing)}, not installed here: run `make install-vllm` "
            f"(scripts/bootstrap --with-vllm)"
        )


def stack_config(args: argparse.Namespace):
    from pathlib import Path

    from kvoffload_testing.stack_config import DEFAULT_HOME, StackConfig, ensure_tiny_model
    from svcruntime.tls import from_args

    _check_engine(args)
    tls = from_args(args, serving="every service of the stack")  # TLSConfigError names the flag and the path
    if args.engine == "vllm":
        from kvoffload_testing.model_fetch import FetchError
        from kvoffload_testing.vllm_stack import DEFAULT_MAX_MODEL_LEN, default_model

        try:
            model = Path(args.model) if args.model else default_model()
        except FetchError as exc:  # says why and what to do
            print(f"kvoffload {args.command}: cannot build the default model: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        default_len = DEFAULT_MAX_MODEL_LEN
    else:
        model = ensure_tiny_model(DEFAULT_HOME / "models" / "tiny") if args.model == "tiny" else _reference_model(args)
        default_len = REFERENCE_MAX_MODEL_LEN
    sizes = _model_sizes(model, default_len)
    max_model_len = sizes["max_model_len"] if args.max_model_len is None else args.max_model_len
    mode = getattr(args, "mode", "pd")
    if mode == "offload-only" and args.api_key:
        args.parser.error(
            "--api-key (or $KVOFFLOAD_API_KEY): --mode offload-only runs no proxy, and the proxy is "
            "what checks the key; unset it or use --mode pd"
        )
    ports = {"prefill_ports": (args.port,)} if mode == "offload-only" else {"proxy_port": args.port}
    return StackConfig(
        model=model,
        log_dir=Path(args.log_dir) if args.log_dir else DEFAULT_HOME / "logs",
        max_model_len=max_model_len,
        tls=tls,
        api_key=args.api_key or None,
        pool=args.pool,
        mode=mode,
        topk_buffer_size=sizes["topk_buffer_size"],
        prefill_pool_gb=sizes["prefill_pool_gb"],
        decode_dram_gb=sizes["decode_dram_gb"],
        **ports,
    )


def _reference_model(args: argparse.Namespace):
    """The reference engine's model: ``--model`` DIR, or ``smollm2`` / none: SmolLM2-135M-Instruct with
    its indexer, built on first use (a 93 MB download, a conversion and the indexer's calibration,
    about 2 minutes once per machine). (``tiny``, the seeded random DSA model: ``stack_config``.)"""
    from pathlib import Path

    if args.model not in (None, "smollm2"):
        return Path(args.model)
    from kvoffload_testing.model_fetch import FetchError
    from kvoffload_testing.model_indexer import served_model

    try:
        return served_model("smollm2", log=lambda line: print(f"kvoffload {args.command}: {line}", file=sys.stderr))
    except FetchError as exc:  # says why and what to do
        print(f"kvoffload {args.command}: cannot build SmolLM2: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def _model_sizes(model, default_len: int) -> dict:
    """Sizes that follow the model when its config can be read (a directory that holds none is
    refused by the services, with the reason, when they start): max_model_len at most its
    positions, the decode's hot buffer twice its index_topk, the prefill's pool room for two prompts
    of max_model_len, the decode's pool for its 8 sequences of max_model_len; else the defaults."""
    try:
        from dsamodel.served import read_config
        from kvoffload_engine.model_layout import kv_layout

        config = read_config(model)
    except (ValueError, OSError):
        return {"max_model_len": default_len, "topk_buffer_size": 128, "prefill_pool_gb": 0.25, "decode_dram_gb": 1}
    max_len = min(default_len, config.max_position_embeddings)
    topk = config.index_topk or 64
    layout = kv_layout(config, 16)
    row_bytes = sum(layer.row_bytes for layer in layout.layers)  # a token's rows: prefill pool (indexer too)
    main_bytes = sum(layer.main.row_bytes for layer in layout.layers)  # a token's rows: decode pool
    return {
        "max_model_len": max_len,
        "topk_buffer_size": -(-2 * topk // 16) * 16,
        "prefill_pool_gb": max(0.25, round(2 * max_len * row_bytes / 2**30, 2)),
        "decode_dram_gb": max(1, -(-DECODE_MAX_NUM_SEQS * max_len * main_bytes // 2**30)),
    }


def make_stack(args: argparse.Namespace, cfg):
    if args.engine == "vllm":
        from kvoffload_testing.vllm_stack import VllmStack

        return VllmStack(cfg)
    from kvoffload_testing.stack import Stack

    return Stack(cfg)


def cmd_up(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvoffload_testing.stack import API_KEY_ENV

    cfg = stack_config(args)
    stack = make_stack(args, cfg)
    stack.start()
    print(f"kvoffload is up: {stack.url}  (logs in {cfg.log_dir}; Ctrl-C stops everything)")
    auth = f' -H "Authorization: Bearer ${API_KEY_ENV}"' if cfg.api_key else ""
    print(
        f"  curl {stack.url}/v1/completions -H 'Content-Type: application/json'{auth} "
        """-d '{"prompt": "Hello", "max_tokens": 16, "temperature": 0}'"""
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            dead = [s.name for s in stack.services if not s.running]
            if dead:
                print(f"kvoffload: {', '.join(dead)} exited; stopping the stack (see {cfg.log_dir})", file=sys.stderr)
                return 1
    finally:
        stack.stop()
        print("kvoffload: stopped", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    cfg = stack_config(args)
    if args.engine == "vllm":
        from kvoffload_testing import vllm_demo as demo
    else:
        from kvoffload_testing import reference_demo as demo  # type: ignore[no-redef]  # same names, either engine

    text, summary = demo.run_demo(cfg, demo.DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens)
    if args.engine != "vllm" and args.model == "tiny":
        print("note: the tiny model's weights are random, so its text is meaningless (the default model is SmolLM2)")
    else:
        print(f"question (at the end of a {summary['prompt_tokens']}-token prompt): {demo.DEMO_QUESTION}")
    print(f"answer ({summary['completion_tokens']} tokens): {text!r}")
    print(json.dumps(summary))
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """``kvoffload up`` and ``kvoffload demo``: the flags both take (``_add_stack_arguments``) and each
    one's own, on the command's subparsers ``sub``."""
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
        _add_stack_arguments(cmd)
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


def _add_stack_arguments(cmd: argparse.ArgumentParser) -> None:
    """The flags ``up`` and ``demo`` share: engine, model, ports, logs, pool, API key, TLS."""
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
