"""svcruntime: what every kvoffload service process shares, and nothing of any one service; and the
one launcher of child server processes that the tools running services build on.

- ``flags``: the flags the model services declare alike (``add_model_service_flags``,
  ``add_shared_flag``, ``add_process_flags``) and the numeric flag rules (``check_flags``).
- ``tls``: TLS / mTLS flags and credentials for every gRPC server and client.
- ``logs``: one logging set-up (JSON lines, the service and request id on every line).
- ``ledger``: the per-request stage ledger and its watchdog.
- ``serving``: the process lifecycle: start-up errors, the gRPC side (health + Stats), the HTTP
  side with drain on SIGTERM (``draining_app``, ``error_response``), and the ordered shutdown.
- ``ranks``: a service's TP rank processes (``RankProcesses``), rank 0's side of the group
  (``LeadRanks``: readiness, orderly close) and a follower's join.
- ``sse``: server-sent events in the OpenAI streaming format.
- ``native_output``: what a native library prints during a call, captured to quote in an error.
- ``serverprocess``: ``ServerProcess``, one child server process (spawn, wait until it answers, stop,
  kill, restart; the pool servers', the stacks' and the vLLM servers' launcher); ``processgroup``: a
  child's whole process group (its members, a signal to all, a stop that waits for every one).
"""

__version__ = "0.1.0"
