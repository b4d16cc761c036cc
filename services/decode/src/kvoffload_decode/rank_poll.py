"""TP: the decode loop's polls of its follower ranks (``RankPolling``, a part of ``DecodeLoop``).

On a TP decode (the loop's decoder is a ``LeadDecoder``) every rank pulls its own share of each
prompt, so rank 0 runs a request only once every follower holds its prompt whole too: while a
request rank 0 holds whole waits on them, the loop asks the followers (``LeadDecoder.poll``) which
requests they hold whole (pausing ``RANK_POLL_S`` between polls while nothing runs) and marks
those ``ranks_whole``. A poll that fails (a follower is gone) fails the requests that waited on it.

It works on the loop's state (``lead``, ``engine_lock`` and ``lock``, ``pending``; ``kvoffload_decode.loop_state``).
"""

from __future__ import annotations

import structlog

from kvoffload_decode.loop_state import LoopState
from kvoffload_decode.request import DecodeRequest

log = structlog.get_logger(__name__)

RANK_POLL_S = 0.002  # TP: the pause between polls of the follower ranks while a request waits on them


class RankPolling(LoopState):
    """``DecodeLoop``'s polls of the follower ranks (module doc)."""

    def _awaiting_ranks(self) -> list[DecodeRequest]:
        """Under ``lock``, TP: the requests rank 0 holds whole that not every follower has confirmed."""
        if self.lead is None:
            return []
        return [r for r in self.pending.values() if r.prompt_complete and r.reserved and not r.ranks_whole]

    def _poll_ranks(self) -> bool:
        """TP: ask the followers which requests they hold whole; True when one became runnable. A
        poll that fails (a follower is gone) fails the requests that waited on it."""
        lead = self.lead
        if lead is None:  # not TP
            return False
        with self.lock:
            waiting = self._awaiting_ranks()
        if not waiting:
            return False
        try:
            with self.engine_lock:
                answers = lead.poll()
        except Exception as exc:  # noqa: BLE001 - a follower gone fails its requests, never the loop thread
            log.error("tp_poll_failed", error=repr(exc), request_ids=[r.request_id for r in waiting])
            for req in waiting:
                req.emit("error", f"decode TP ranks: {exc}")
                self.cancel(req.request_id, str(exc), outcome="error")
            return False
        whole = set.intersection(*(set(a) for a in answers))
        with self.lock:
            ready = [r for r in waiting if r.request_id in whole and r.request_id in self.pending]
            for req in ready:
                req.ranks_whole = True
            if ready:
                self.lock.notify_all()
        return bool(ready)
