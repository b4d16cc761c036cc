"""vLLM start-ups that must fail, many in one process: ``python vllm_refusals.py`` reads
``{case: [server args...]}`` (JSON) on stdin and prints one ``RESULT {json}`` line per case.

A real ``vllm serve`` pays three interpreters importing vLLM (API server, engine core, worker: ~35 s on
2 cores) before our connector's constructor runs. Here vLLM is imported once and each case goes the
same way a server goes up to the engine: the API server's own argument parser and checks
(``make_arg_parser``, ``validate_parsed_serve_args``), ``AsyncEngineArgs.from_cli_args``, the engine
config, then an engine built in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core
and its one worker in-process), whose worker and scheduler construct the KV connectors. The result of
a case is the exception that stopped it, with its causes, and what the process logged meanwhile; a
case that built its engine reports ``started: true``. The exit path itself (a server that exits
non-zero, its log) stays covered by at least one real launch per test module.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM reads its environment


def start(argv: list[str]) -> None:
    """Build the engine ``python -m vllm.entrypoints.openai.api_server *argv`` would build, in-process."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.llm_engine import LLMEngine

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    engine = LLMEngine.from_engine_args(AsyncEngineArgs.from_cli_args(args), UsageContext.OPENAI_API_SERVER)
    engine.engine_core.shutdown()


def reset() -> None:
    """What a case left behind in this process (the distributed groups, a KV connector agent)."""
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.distributed.kv_transfer import kv_transfer_state

    kv_transfer_state._KV_CONNECTOR_AGENT = None
    cleanup_dist_env_and_memory()


def main() -> None:
    cases: dict[str, list[str]] = json.load(sys.stdin)
    results = []
    for name, argv in cases.items():
        log_path = f"{os.environ['VLLM_REFUSALS_LOG_DIR']}/{name}.log"
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        with open(log_path, "w") as log:  # this case's log: everything written to stdout and stderr meanwhile
            for fd in saved:
                os.dup2(log.fileno(), fd)
            try:
                start(argv)
                result = {"started": True, "error": ""}
            except BaseException as exc:  # noqa: BLE001 - SystemExit from argparse is a refusal too
                result = {"started": False, "error": "".join(traceback.format_exception(exc))}
            finally:
                reset()
                sys.stdout.flush()
                sys.stderr.flush()
                for fd, copy in saved.items():
                    os.dup2(copy, fd)
                    os.close(copy)
        results.append({"case": name, "log": log_path, **result})
    for result in results:
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
