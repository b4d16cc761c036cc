"""The registration rendezvous behind POST /v1/metaserver ("decode first").

A client request with k prompts opens one `Rendezvous` for its k child ids *before* any decoder
is contacted. Each decoder, once it holds host memory for its child, POSTs its endpoint params;
when the last child registered, the rendezvous runs the prefill dispatch exactly once (one batched
request for all children) and every registration call is answered with that single outcome.

Hooks, by caller (all on the event loop; nothing blocks the loop):
- request flow (the client's handler task):
  `Registry.open(parent_id, child_ids, context)` -> `Rendezvous`, before dispatching to decoders.
  `Rendezvous.outcome`: a future that resolves to None once the prefill answered, or to the
  `ProxyError` that failed the request; the flow watches it to fail fast.
  `Registry.close(rdv, error, answered=False)`: in `finally:`; idempotent; cancels a running
  dispatch and answers waiting decoders with `error` (410 "cancelled" by default). Forgets the
  child ids. `answered=True` (every decoder finished its answer): a dispatch still running is left
  to finish instead — its prefiller has done the work (the decoders pulled every layer) and is only
  answering, and cancelling it now would make that server count an aborted request; the dispatch,
  bounded as ever, then answers the waiting decoders itself. `Registry.aclose()` cancels those.
- metaserver route (one task per decoder call): `Registry.register(child_id, params)`; waits for the
  outcome and returns (-> 200 {"status": "ok"}) or raises `ProxyError` (-> that status). A repeated
  call with the same params (a decoder retrying a lost answer) joins the same outcome; different
  params after the dispatch started are a 409. The registration itself survives the caller's
  cancellation: a decoder that drops the connection has still registered.

Bounds (I6): the registration deadline (`registration_timeout_s`, from `open`) fails a rendezvous
whose children did not all register (504, naming them); the dispatch is bounded by
`dispatch_timeout_s` (504). So every `register` call and every flow waiting on `outcome` ends.

One deadline per request: the registration deadline covers only the time until a decoder has
*admitted* the child. A decoder that admits a child into its queue but cannot reserve its host
blocks yet says so with a registration whose params are `{"request_id": ..., "queued": true}`:
answered at once, it exempts that child from the registration deadline (`Rendezvous.queued`); the
child then registers for real when it got its blocks. Such a child waits as long as the client
request lives — bounded by the client, the flow's silence backstop (`--request-timeout-s`) and the
decoder's own connection (a decoder that dies fails the flow's request to it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from openai_api.transfer_params import KVTransferParams

from .errors import ProxyError

log = structlog.get_logger("kvoffload_proxy.metaserver")
Dispatch = Callable[["Rendezvous"], Awaitable[None]]


class Rendezvous:
    """Facts about one client request's registrations; the registry changes them."""

    def __init__(self, parent_id: str, child_ids: tuple[str, ...], context: Any):
        self.parent_id = parent_id
        self.child_ids = child_ids
        self.context = context
        self.params: dict[str, KVTransferParams] = {}
        self.outcome: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.outcome.add_done_callback(_mark_retrieved)
        self._dispatch_task: asyncio.Task[None] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self.queued: set[str] = set()  # children a decoder queued: no registration deadline for them
        self.closed = False  # the client request ended (`Registry.close`)

    @property
    def missing_ids(self) -> list[str]:
        return [c for c in self.child_ids if c not in self.params]

    @property
    def is_complete(self) -> bool:
        return len(self.params) == len(self.child_ids)

    @property
    def dispatch_started(self) -> bool:
        return self._dispatch_task is not None

    def ordered_params(self) -> list[KVTransferParams]:
        return [self.params[c] for c in self.child_ids]


def _mark_retrieved(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


class Registry:
    def __init__(self, dispatch: Dispatch, *, registration_timeout_s: float, dispatch_timeout_s: float):
        self._dispatch = dispatch
        self.registration_timeout_s = registration_timeout_s
        self.dispatch_timeout_s = dispatch_timeout_s
        self._by_child: dict[str, Rendezvous] = {}
        self._finishing: set[asyncio.Task[None]] = set()  # dispatches of answered requests

    def __len__(self) -> int:
        """Open rendezvous (0 when idle: nothing leaked)."""
        return len({id(r) for r in self._by_child.values()})

    def lookup(self, child_id: str) -> Rendezvous | None:
        return self._by_child.get(child_id)

    def open(self, parent_id: str, child_ids: tuple[str, ...], context: Any = None) -> Rendezvous:
        clash = [c for c in child_ids if c in self._by_child]
        if clash or len(set(child_ids)) != len(child_ids):
            raise ValueError(f"request ids already waiting for registration: {clash or child_ids}")
        rdv = Rendezvous(parent_id, child_ids, context)
        for c in child_ids:
            self._by_child[c] = rdv
        rdv._deadline = asyncio.get_running_loop().call_later(self.registration_timeout_s, self._expire, rdv)
        return rdv

    async def register(self, child_id: str, params: KVTransferParams) -> None:
        rdv = self._by_child.get(child_id)
        if rdv is None:
            raise ProxyError(
                404,
                f"unknown request_id {child_id!r}: no client request is waiting "
                "for it (finished, cancelled, timed out or never sent)",
                param="request_id",
            )
        if params.queued:  # admitted, waiting for host blocks: answered at once
            if rdv.outcome.done():
                await rdv.outcome  # raises the error that ended the request
            if child_id not in rdv.params:
                rdv.queued.add(child_id)
                log.info("decoder_queued", parent_id=rdv.parent_id, child_id=child_id)
            return
        known = rdv.params.get(child_id)
        if known is not None and known != params and rdv.dispatch_started:
            raise ProxyError(
                409,
                f"request_id {child_id!r} already registered with other "
                "kv_transfer_params and its prefill was dispatched",
                param="kv_transfer_params",
            )
        if not rdv.outcome.done():
            if known is None:
                log.info(
                    "decoder_registered",
                    parent_id=rdv.parent_id,
                    child_id=child_id,
                    remote=f"{params.remote_host}:{params.remote_port}",
                    remote_dp_rank=params.remote_dp_rank,
                    remote_tp_size=params.remote_tp_size,
                )
            rdv.params[child_id] = params
            if rdv.is_complete and not rdv.dispatch_started:
                self._start_dispatch(rdv)
        # shield: the decoder dropping this call must not cancel the shared outcome
        await asyncio.wait_for(asyncio.shield(rdv.outcome), self.registration_timeout_s + self.dispatch_timeout_s + 1.0)

    def close(self, rdv: Rendezvous, error: ProxyError | None = None, *, answered: bool = False) -> None:
        rdv.closed = True
        if rdv._deadline is not None:
            rdv._deadline.cancel()
        task = rdv._dispatch_task
        if answered and task is not None and not task.done():
            log.info("prefill_left_to_finish", parent_id=rdv.parent_id)
            self._finishing.add(task)
            task.add_done_callback(self._finishing.discard)
        else:
            if task is not None and not task.done():
                task.cancel()
            self._resolve(
                rdv,
                error
                or ProxyError(
                    410,
                    f"request {rdv.parent_id} ended before its prefill completed (client "
                    "disconnected or the request failed)",
                ),
            )
        for c in rdv.child_ids:
            if self._by_child.get(c) is rdv:
                del self._by_child[c]

    async def aclose(self) -> None:
        """Cancel the dispatches left to finish (shutdown) and wait for them."""
        tasks = list(self._finishing)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _start_dispatch(self, rdv: Rendezvous) -> None:
        if rdv._deadline is not None:
            rdv._deadline.cancel()
        log.info("prefill_dispatch_start", parent_id=rdv.parent_id, children=len(rdv.child_ids))
        rdv._dispatch_task = asyncio.get_running_loop().create_task(self._run_dispatch(rdv))

    async def _run_dispatch(self, rdv: Rendezvous) -> None:
        try:
            await asyncio.wait_for(self._dispatch(rdv), self.dispatch_timeout_s)
        except ProxyError as e:
            self._resolve(rdv, e)
        except asyncio.TimeoutError:
            self._resolve(
                rdv,
                ProxyError(
                    504,
                    f"prefill dispatch for {rdv.parent_id} did not complete within {self.dispatch_timeout_s:g}s",
                    role="prefiller",
                ),
            )
        except asyncio.CancelledError:
            self._resolve(rdv, ProxyError(410, f"prefill dispatch for {rdv.parent_id} cancelled"))
            raise
        except Exception as e:  # a bug in the dispatch must still answer every waiter
            log.exception("prefill_dispatch_crashed", parent_id=rdv.parent_id)
            self._resolve(rdv, ProxyError(502, f"prefill dispatch failed: {e!r}", role="prefiller"))
        else:
            self._resolve(rdv, None)

    def _expire(self, rdv: Rendezvous) -> None:
        if rdv.is_complete or rdv.outcome.done():
            return
        missing = [c for c in rdv.missing_ids if c not in rdv.queued]
        if not missing:  # every missing child is queued at its decoder: it registers when admitted
            return
        self._resolve(
            rdv,
            ProxyError(
                504,
                f"{len(missing)} of {len(rdv.child_ids)} decoder(s) did not register at "
                f"/v1/metaserver within {self.registration_timeout_s:g}s "
                f"(request ids: {', '.join(missing)})",
                role="decoder",
            ),
        )

    @staticmethod
    def _resolve(rdv: Rendezvous, error: ProxyError | None) -> None:
        if rdv.outcome.done():
            return
        if error is None:
            rdv.outcome.set_result(None)
        else:
            rdv.outcome.set_exception(error)
