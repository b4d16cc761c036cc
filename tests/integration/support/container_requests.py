"""Requests to the container stack's proxy, as a client sends them (plain urllib): ``complete`` (greedy
token ids, JSON or SSE), ``Background`` (one request in a thread, to stop a container under it), and
the prompts' tokenizer and long text. Shared by ``test_containers`` and ``test_containers_mooncake``."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

from kvoffload_testing.sse import sse_events, token_ids

ERROR_DEADLINE_S = 60.0  # a request hit by a stopped container must end with an error within this


def complete(
    url: str,
    prompt: list[int],
    max_tokens: int,
    stream: bool = False,
    timeout_s: float = 300.0,
    request_id: str | None = None,
) -> list[int]:
    """Greedy token ids of one completion through the proxy (sent with ``X-Request-Id`` when
    ``request_id`` is given); raises on any error (SSE error events too)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        if not stream:
            return json.loads(resp.read())["choices"][0]["token_ids"]
        ids: list[int] = []
        for event in sse_events(resp, require_done=True):  # StreamTruncated without data: [DONE]
            if "error" in event:
                raise RuntimeError(f"SSE error event: {event['error']}")
            ids += token_ids(event)
        return ids


class Background:
    """One request in a thread: its outcome (tokens or the error) and when it ended."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int, stream: bool) -> None:
        self.tokens: list[int] | None = None
        self.error: str | None = None
        self.ended_at: float | None = None
        self._th = threading.Thread(target=self._run, args=(url, prompt, max_tokens, stream), daemon=True)
        self._th.start()

    def _run(self, url, prompt, max_tokens, stream) -> None:
        try:
            self.tokens = complete(url, prompt, max_tokens, stream, timeout_s=ERROR_DEADLINE_S + 30)
        except urllib.error.HTTPError as exc:
            self.error = f"HTTP {exc.code}: {exc.read()[:500].decode(errors='replace')}"
        except Exception as exc:  # noqa: BLE001 - every failure is an outcome to judge
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended_at = time.monotonic()

    def join(self, timeout_s: float) -> None:
        self._th.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._th.is_alive()


def byte_tokenizer():
    from dsamodel.tokenizer import ByteTokenizer

    return ByteTokenizer()


LONG_TEXT = "".join(chr(32 + (i * 7919) % 90) for i in range(7900))
