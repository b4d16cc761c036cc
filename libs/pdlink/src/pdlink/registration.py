"""A decode's registration of one request at the proxy's ``/v1/metaserver``, in one place for both
decodes (the reference decode service and the vLLM D2H consumer): the message (``Registration``: its
JSON body and headers), the retry policy while the metaserver cannot be reached (``RETRIES``,
``backoff_s``), the words for a refusal or an unreachable metaserver, and the blocking client
(``post``) the vLLM consumer runs on its own thread. The decode service sends the same message with
the same policy from its event loop (``kvoffload_decode.app``), where a registration is cancelled
when its request fails.

The registration names the control endpoint of the decode's TP rank 0 and its TP size (rank t
listens on that port + t) and DP rank; the proxy answers once the prefill answered. Every TP rank
of a vLLM decode posts the same registration (the proxy takes a repeat as the same one), so each
learns from its own answer when the prefill's reads are due. ``queued`` tells
the proxy instead that the request waits for room here (answered at once).
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from dataclasses import dataclass

from openai_api.transfer_params import KVTransferParams

RETRIES = 3  # retries while the metaserver cannot be reached (an HTTP answer is never retried)


def backoff_s(attempt: int) -> float:
    """The pause before retry ``attempt + 1``."""
    return 0.2 * 2**attempt


@dataclass(frozen=True)
class Registration:
    """One request's registration: ``metaserver`` (the URL its ``kv_transfer_params`` named), the
    proxy's per-request ``token`` (set when the proxy has an API key), where the decode listens."""

    request_id: str
    metaserver: str
    token: str | None = None
    host: str = ""
    port: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    queued: bool = False

    def body(self) -> dict:
        """The POST's JSON body."""
        params = (
            KVTransferParams(request_id=self.request_id, queued=True)
            if self.queued
            else KVTransferParams(
                request_id=self.request_id,
                remote_host=self.host,
                remote_port=self.port,
                remote_tp_size=self.tp_size,
                remote_dp_rank=self.dp_rank,
            )
        )
        return {"request_id": self.request_id, "kv_transfer_params": params.wire()}

    def headers(self) -> dict[str, str]:
        out = {"Content-Type": "application/json", "X-Request-Id": self.request_id}
        if self.token:
            out["Authorization"] = f"Bearer {self.token}"
        return out

    def refused(self, status: int, text: str) -> str:
        """What failed when the metaserver answered ``status`` (not 2xx)."""
        return f"metaserver {self.metaserver} answered {status}: {text[:500]}"

    def unreachable(self, attempts: int, exc: BaseException) -> str:
        return f"metaserver {self.metaserver} unreachable after {attempts} attempts: {exc!r}"


def post(reg: Registration, *, timeout_s: float, stop: threading.Event, retries: int = RETRIES) -> str:
    """POST ``reg`` (blocking): "" once answered 2xx, else why not (an HTTP error at once; unreachable
    after ``retries`` retries, or ``stop`` set meanwhile)."""
    import json

    data = json.dumps(reg.body()).encode()
    problem = ""
    for attempt in range(retries + 1):
        try:
            req = urllib.request.Request(reg.metaserver, data=data, headers=reg.headers(), method="POST")
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                resp.read()
            return ""
        except urllib.error.HTTPError as exc:
            return reg.refused(exc.code, exc.read().decode(errors="replace"))
        except (urllib.error.URLError, OSError) as exc:
            problem = reg.unreachable(attempt + 1, exc)
            if stop.wait(backoff_s(attempt)):
                break
    return problem
