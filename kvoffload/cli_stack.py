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
        model = Path(args.model) if args.model else ensure_tiny_model(DEFAULT_HOME / "models" / "tiny")
        default_len = REFERENCE_MAX_MODEL_LEN
    max_model_len = default_len if args.max_model_len is None else args.max_model_len
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
        **ports,
    )


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
    import time

    from kvoffload_testing.stack import Stack
    from kvoffload_testing.stack_client import post_json, stack_stats

    cfg = stack_config(args)
    if args.engine == "vllm":
        from kvoffload_testing.vllm_demo import DEFAULT_MAX_TOKENS, DEMO_QUESTION, run_demo

        text, summary = run_demo(cfg, DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens)
        print(f"question (after a {summary['prompt_tokens']}-token prompt): {DEMO_QUESTION}")
        print(f"answer ({summary['completion_tokens']} tokens): {text!r}")
        print(json.dumps(summary))
        return 0
    prompt = (
        "kvoffload keeps almost no KV cache in accelerator memory: layerwise offload on prefill, "
        "sparse offload on decode, a remote pull in between. "
    ) * 40
    with Stack(cfg) as stack:
        t = time.monotonic()
        answer = post_json(
            f"{stack.url}/v1/completions",
            {"prompt": prompt, "max_tokens": 32 if args.max_tokens is None else args.max_tokens, "temperature": 0},
            headers=stack.auth_headers,
        )
        elapsed = time.monotonic() - t
        stats = stack_stats(cfg)
    choice = answer["choices"][0]
    p, d = stats["prefill-0"], stats["decode-0"]
    summary = {
        "prompt_tokens": answer["usage"]["prompt_tokens"],
        "completion_tokens": answer["usage"]["completion_tokens"],
        "token_ids": choice["token_ids"],
        "seconds": round(elapsed, 3),
        "prefill_device_kv_bytes": int(p["device_kv_bytes"]),
        "prefill_pool_used_bytes": int(p["pool_used_bytes"]),
        "decode_bytes_pulled": int(d["bytes_read"]),
        "decode_layer_pulls": int(d["read_done"]),
        "decode_pool_used_bytes_after": int(d["pool_used_bytes"]),
        "prefill_held_slots_after": int(p["held_slots"]),
    }
    if "metastore" in stats:  # pool "kvoffload" (with --pool mooncake the stack runs no metastore)
        summary["metastore"] = {
            k: stats["metastore"][k] for k in sorted(stats["metastore"]) if k.startswith(("objects", "pools", "live"))
        }
    if not args.model:
        print(
            "note: the tiny model's weights are random, so its text is meaningless; "
            "`make demo-vllm` shows real text (SmolLM2 under vLLM)"
        )
    print(
        f"answer ({summary['completion_tokens']} tokens after a {summary['prompt_tokens']}-token prompt): "
        f"{choice['text']!r}"
    )
    print(json.dumps(summary))
    return 0
