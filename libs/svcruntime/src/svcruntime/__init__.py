"""svcruntime: what every kvoffload service process shares, and nothing of any one service.

- ``flags``: the numeric command-line flag rules (``check_flags``).
- ``tls``: TLS / mTLS flags and credentials for every gRPC server and client.
- ``logs``: one logging set-up (JSON lines, the service and request id on every line).
- ``ledger``: the per-request stage ledger and its watchdog.
- ``serving``: the process lifecycle: start-up errors, the gRPC side (health + Stats), the HTTP
  side with drain on SIGTERM, and the ordered shutdown.
"""

__version__ = "0.1.0"
