"""GET /v1/models: the models the decoders serve, in the OpenAI list format.

The proxy serves no model of its own: a client's request goes to a decoder (and its prefill to a
prefiller started with the same --served-model-name), so the ids a client may name are the ones
the decoders serve. Each decoder is asked its own `GET /v1/models` (the decode service and vLLM
both answer it), all concurrently, each bounded by --health-timeout-s. The ids of the decoders that
answered 200 with a well-formed list are merged in decoder order, de-duplicated (the first
decoder listing an id gives its entry). A decoder that is down, slow or answers garbage is left
out and logged; only when none answers is it a 503.

The merged list is cached for `ttl_s` (5 s): a client polling /v1/models does not fan out to every
decoder each time, and a decoder that came back or changed its model shows within seconds. One
refresh runs at a time; concurrent callers share it (a caller that disconnects does not cancel
it). Failures are not cached.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import structlog

from .config import Backend
from .errors import ProxyError, excerpt

log = structlog.get_logger("kvoffload_proxy.models")
TTL_S = 5.0
MAX_ANSWER_BYTES = 1 << 20  # a model list is a few hundred bytes; more is not a model list
OWNED_BY = "kvoffload"


def parse_model_list(text: str, default_created: int) -> list[dict[str, Any]]:
    """The entries of one decoder's /v1/models answer, normalized to the OpenAI model object
    (`id`, `object: "model"`, `created`, `owned_by`; other keys, e.g. vLLM's `max_model_len`,
    kept). Raises ValueError when the answer is not an OpenAI model list."""
    body = json.loads(text)
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise ValueError("not an OpenAI model list (no `data` array)")
    out = []
    for entry in body["data"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or not entry["id"]:
            raise ValueError(f"model entry without a string `id`: {excerpt(json.dumps(entry), 100)}")
        created = entry.get("created")
        owned_by = entry.get("owned_by")
        out.append(
            {
                **entry,
                "id": entry["id"],
                "object": "model",
                "created": created if type(created) is int and created >= 0 else default_created,
                "owned_by": owned_by if isinstance(owned_by, str) and owned_by else OWNED_BY,
            }
        )
    return out


class ModelCatalog:
    def __init__(self, decoders: Sequence[Backend], timeout_s: float, ttl_s: float = TTL_S):
        self.decoders = tuple(decoders)
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self.started = int(time.time())  # `created` of an entry whose decoder gave none
        self._cached: list[dict[str, Any]] | None = None
        self._fetched_at = 0.0
        self._refresh: asyncio.Future | None = None

    async def models(
        self, session: aiohttp.ClientSession, headers: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """The merged model entries; raises ProxyError(503) when no decoder answered."""
        if self._cached is not None and time.monotonic() - self._fetched_at < self.ttl_s:
            return self._cached
        if self._refresh is None:
            self._refresh = asyncio.ensure_future(self._fetch_all(session, headers or {}))
            self._refresh.add_done_callback(self._refreshed)
        return await asyncio.shield(self._refresh)

    def _refreshed(self, fut: asyncio.Future) -> None:
        self._refresh = None
        if fut.cancelled() or fut.exception() is not None:  # retrieved: no "never retrieved" warning
            return
        self._cached, self._fetched_at = fut.result(), time.monotonic()

    async def _fetch_all(
        self,
        session: aiohttp.ClientSession,
        headers: dict[str, str],
    ) -> list[dict[str, Any]]:
        answers = await asyncio.gather(*(self._fetch(session, d, headers) for d in self.decoders))
        failures = [a for a in answers if isinstance(a, str)]
        if len(failures) == len(answers):
            raise ProxyError(
                503,
                "no decoder answered GET /v1/models: " + "; ".join(failures),
                role="decoder",
                headers={"Retry-After": "1"},
            )
        merged: dict[str, dict[str, Any]] = {}
        for entries in answers:
            if not isinstance(entries, str):
                for entry in entries:
                    merged.setdefault(entry["id"], entry)
        return list(merged.values())

    async def _fetch(
        self, session: aiohttp.ClientSession, decoder: Backend, headers: dict[str, str]
    ) -> list[dict[str, Any]] | str:
        """That decoder's entries, or why it has none (a string naming it)."""
        try:
            async with session.get(
                decoder.url + "/v1/models", headers=headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as resp:
                raw = bytearray()
                async for chunk in resp.content.iter_any():
                    raw += chunk
                    if len(raw) > MAX_ANSWER_BYTES:
                        raise ValueError(f"answer larger than {MAX_ANSWER_BYTES} bytes")
                text = raw.decode("utf-8", errors="replace")
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}: {excerpt(text, 200)}")
                return parse_model_list(text, self.started)
        except asyncio.TimeoutError:
            error = f"no answer within {self.timeout_s:g}s"
        except aiohttp.ClientError as e:
            error = f"{type(e).__name__}: {e}"
        except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
            error = str(e)
        log.warning("decoder_models_unavailable", decoder=decoder.url, error=error)
        return f"{decoder.url}: {error}"
