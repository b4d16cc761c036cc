"""``kvoffload up`` / ``kvoffload demo``: the stack on loopback from the command line, on the reference
engine or on vLLM (``--engine``): the flags each engine takes, the ``StackConfig`` they make, the
running stack watched until Ctrl-C, and the demo's one request and summary."""

from __future__ import annotations

import argparse
import json
import sys

from kvcore.poolregistry import EMBEDDED, VLLM_POOLS

ENGINES = ("reference", "vllm")
# `up` / `demo` flags only the reference engine takes (argparse dest -> flag), and why not vLLM's
REFERENCE_ONLY = {"tls_cert": "--tls-cert", "tls_key": "--tls-key", "tls_ca": "--tls-ca"}
REFERENCE_ONLY_WHY = (
    "the vLLM connectors do not speak TLS to the metastore yet, and their store runs on backend "
    "'kvoffload' only (docs/vllm.md)"
)
MODES = ("pd", "offload-only")  # `up --mode` (== kvoffload_testing.stack.MODES; not imported: --help stays light)
REFERENCE_MAX_MODEL_LEN = 16384
DECODE_MAX_NUM_SEQS = 8  # the stack's decode (kvoffload-decode's default --max-num-seqs)
VLLM_MAX_MODEL_LEN = 4096  # kvoffload_testing.vllm_stack.DEFAULT_MAX_MODEL_LEN (not imported here: --help stays light)


def _check_engine(args: argparse.Namespace) -> None:
    """Refuse (exit 2, with the subcommand's usage) what the chosen engine cannot honour."""
    if args.engine != "vllm":
        return
    given = [flag for dest, flag in REFERENCE_ONLY.items() if getattr(args, dest, None) is not None]
    if getattr(args, "pool", EMBEDDED) not in VLLM_POOLS:
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

    from kvoffload_testing.stack import DEFAULT_HOME, StackConfig, ensure_tiny_model
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
        from kvoffload_engine.layout import kv_layout

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
