"""The decode's registration of one request at the proxy's ``/v1/metaserver``: a POST of the
control endpoint of the decode's TP rank 0 and its TP size (``kv_transfer_params``: rank t listens
on that port + t), which the proxy answers once the prefill answered, retried a few times while the
metaserver cannot be reached. Every TP rank posts the same registration (the proxy takes a repeat
as the same one), so each learns from its own answer when the prefill's reads are due."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

from kvoffload_vllm.d2h_settings import D2HSettings
from kvoffload_vllm.d2h_step import Recv
from openai_api.transfer_params import KVTransferParams

REGISTRATION_TIMEOUT_S = 1800.0  # a backstop: the proxy answers within its own request deadline
REGISTRATION_RETRIES = 3


def register(recv: Recv, settings: D2HSettings, stop: threading.Event) -> str:
    """POST the decode's endpoints for ``recv`` to its metaserver: "" once answered 200, else why not
    (an HTTP error at once; unreachable after ``REGISTRATION_RETRIES`` retries, or ``stop`` set)."""
    params = KVTransferParams(
        request_id=recv.transfer_id,
        remote_host=settings.advertise_host,
        remote_port=settings.base_port,
        remote_tp_size=settings.tp_size,
        remote_dp_rank=settings.dp_rank,
    )
    body = json.dumps({"request_id": recv.transfer_id, "kv_transfer_params": params.wire()}).encode()
    headers = {"Content-Type": "application/json", "X-Request-Id": recv.transfer_id}
    if recv.token:
        headers["Authorization"] = f"Bearer {recv.token}"
    problem = ""
    for attempt in range(REGISTRATION_RETRIES + 1):
        try:
            req = urllib.request.Request(recv.metaserver, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=REGISTRATION_TIMEOUT_S) as resp:
                resp.read()
            return ""
        except urllib.error.HTTPError as exc:
            return f"metaserver {recv.metaserver} answered {exc.code}: {exc.read()[:300]!r}"
        except (urllib.error.URLError, OSError) as exc:
            problem = f"metaserver {recv.metaserver} unreachable after {attempt + 1} attempts: {exc}"
            if stop.wait(0.2 * 2**attempt):
                break
    return problem
