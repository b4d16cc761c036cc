"""The fault suite's tally: what each run recorded, what an idle stack still holds, the summary over
the runs and the goal it judges.

``held`` reads the services' Stats counters (``REQUIRED_STATS``: exactly what each service always
reports; a missing one raises ``MissingStatsKey``, never counts as 0); ``summarize`` sums the runs'
figures; ``goal_met`` needs every ``GOAL_ZERO`` figure at 0 (a figure the summary lacks raises
``MissingFigure``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from kvoffload_testing.fault_catalog import FAULTS


@dataclass
class RequestRecord:
    prompt_tokens: int
    stream: bool
    ok: bool = False
    ended: bool = False
    seconds: float = 0.0
    tokens_equal: bool | None = None  # successes only
    error: str = ""
    # failures only: why the error is not the one the run's fault gives (``wrong_error``), "" when it
    # is; None: not judged, which counts as wrong
    wrong_error: str | None = None


@dataclass
class RunRecord:
    run: int
    fault: str
    requests: list[RequestRecord] = field(default_factory=list)
    leaks: dict[str, float] = field(default_factory=dict)
    fresh_ok: bool = False
    seconds: float = 0.0
    # a run with a problem: each service's warnings and errors logged during the run (its last lines)
    logs: dict[str, list[str]] = field(default_factory=dict)

    def has_problem(self) -> bool:
        """The fresh request failed, something leaked, or a request did not end, got wrong tokens or
        the wrong error."""
        return (
            not self.fresh_ok
            or any(v for v in self.leaks.values())
            or any(not q.ended or q.tokens_equal is False or (not q.ok and q.wrong_error != "") for q in self.requests)
        )


LEAK_KEYS = ("leaked_slots", "leaked_pool_bytes", "leaked_leases", "open_requests")

# The Stats counters the tally reads, per kind of service — exactly what each service's GetStats
# always reports (prefill: kvcore.gates + the ledger + the pool + its queue; decode: the loop + the ledger + the
# pool; metastore: kvoffload_metastore.metrics.stats_counters). The prefill reports its pool's
# counters only while the pool answers (``pool_available`` 1); ``pool_available`` 0 counts as open.
REQUIRED_STATS: dict[str, tuple[str, ...]] = {
    "prefill": ("held_slots", "ledger_open", "in_service", "pool_available"),
    "decode": ("pool_used_bytes", "pool_live_leases", "sequences", "ledger_open"),
    "metastore": ("live_leases",),
}
PREFILL_POOL_STATS = ("pool_live_leases",)  # required when pool_available is 1


class MissingStatsKey(LookupError):
    """A service's Stats lack a counter the leak tally needs (renamed or dropped): never read as 0."""


def _kind(name: str) -> str:
    for kind in ("prefill", "decode"):
        if name.startswith(kind + "-") or name == kind:
            return kind
    if name == "metastore":
        return name
    raise MissingStatsKey(
        f"Stats of an unknown service {name!r}: the leak tally knows prefill-N, decode-N and metastore"
    )


def _require(name: str, counters: dict[str, float], keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in counters]
    if missing:
        raise MissingStatsKey(
            f"{name}: Stats lack {', '.join(map(repr, missing))} (the leak tally needs "
            f"{', '.join(keys)}); the keys present are: {sorted(counters)}"
        )


def held(stats: dict[str, dict[str, float]], pool: str = "kvoffload") -> dict[str, float]:
    """What the stack still holds (all zero when idle). Every counter it reads must be present:
    a missing one raises ``MissingStatsKey`` (naming the service, the key and the keys present)
    instead of counting as 0, and so do Stats without the metastore (``pool`` "kvoffload": the
    metastore indexes the prefill's pool; other pools have none), without a prefill or a decode,
    or of an unknown service."""
    if pool == "kvoffload" and "metastore" not in stats:
        raise MissingStatsKey(f"no Stats of the metastore among {sorted(stats)}")
    kinds = {_kind(name) for name in stats}
    if not {"prefill", "decode"} <= kinds:
        raise MissingStatsKey(f"the leak tally needs Stats of a prefill and a decode; got {sorted(stats)}")
    out = dict.fromkeys(LEAK_KEYS, 0.0)
    for name, c in stats.items():
        kind = _kind(name)
        _require(name, c, REQUIRED_STATS[kind])
        if kind == "prefill":
            if c["pool_available"]:
                _require(name, c, PREFILL_POOL_STATS)
                out["leaked_leases"] += c["pool_live_leases"]
            out["leaked_slots"] += c["held_slots"]
            # a request in service is in the ledger too, but for its wait to be admitted to it
            out["open_requests"] += max(c["ledger_open"], c["in_service"]) + (1 - c["pool_available"])
        elif kind == "decode":
            out["leaked_pool_bytes"] += c["pool_used_bytes"]
            out["leaked_leases"] += c["pool_live_leases"]
            out["open_requests"] += c["sequences"] + c["ledger_open"]
        else:
            out["leaked_leases"] += c["live_leases"]
    return out


def _leak_total(leaks: list[dict[str, float]], key: str) -> float:
    """``key`` summed over the runs whose Stats could be read (each of those has every LEAK_KEYS
    entry; a record without it is an error, not a 0). Runs with ``stats_error`` count in
    ``stats_unreadable`` (and ``open_requests_after``) instead."""
    total = 0.0
    for i, x in enumerate(leaks):
        if "stats_error" in x:
            continue
        if key not in x:
            raise MissingStatsKey(f"run {i}: its leak record lacks {key!r}; it has {sorted(x)}")
        total += x[key]
    return total


def summarize(records: list[RunRecord], faults: dict[str, int] = FAULTS) -> dict:
    """The suite's figures over ``records``; ``faults`` (the stack's fault kinds) keys the count of
    runs per kind."""
    strays = sorted({run.fault for run in records} - set(faults))
    if strays:
        raise ValueError(f"runs of faults {strays} that are not among {list(faults)}")
    reqs = [r for run in records for r in run.requests]
    leaks = [run.leaks for run in records]
    unreadable = sum("stats_error" in x for x in leaks)
    return {
        "runs": len(records),
        "requests": len(reqs),
        "terminated": sum(r.ended for r in reqs),
        "succeeded": sum(r.ok for r in reqs),
        "failed_with_error": sum(r.ended and not r.ok for r in reqs),
        # failures whose error is not the one their run's fault gives (status and the peer it names)
        "wrong_errors": sum(not r.ok and r.wrong_error != "" for r in reqs),
        "wrong_tokens": sum(r.ok and r.tokens_equal is False for r in reqs),
        "leaked_slots": _leak_total(leaks, "leaked_slots"),
        "leaked_pool_bytes": _leak_total(leaks, "leaked_pool_bytes"),
        "leaked_leases": _leak_total(leaks, "leaked_leases"),
        "open_requests_after": _leak_total(leaks, "open_requests") + unreadable,
        "stats_unreadable": unreadable,  # runs whose idle Stats could not be read: leaks unknown
        "fresh_request_failures": sum(not run.fresh_ok for run in records),
        "max_termination_s": round(max((r.seconds for r in reqs), default=0.0), 3),
        "faults": {f: sum(run.fault == f for run in records) for f in faults},
    }


# the figures of ``summarize`` that must be 0 for the suite's goal: nothing held or open once the
# stack is idle (and its Stats read), every answer right, every error its fault's own, every fresh
# request after a run served
GOAL_ZERO = (
    "stats_unreadable",
    "leaked_slots",
    "leaked_pool_bytes",
    "leaked_leases",
    "open_requests_after",
    "wrong_tokens",
    "wrong_errors",
    "fresh_request_failures",
)


class MissingFigure(LookupError):
    """A figure the goal is judged on is not in the summary: it was not measured, so no pass."""


def goal_met(summary: dict) -> bool:
    """Whether ``summary`` (``summarize``'s) meets the fault suite's goal: runs and requests took
    place, every request ended within its deadline, and every ``GOAL_ZERO`` figure is 0. A figure
    the summary lacks raises ``MissingFigure`` naming it."""
    missing = [k for k in ("runs", "requests", "terminated", *GOAL_ZERO) if k not in summary]
    if missing:
        raise MissingFigure(f"the fault summary lacks {', '.join(missing)}; it has {sorted(summary)}")
    return (
        summary["runs"] > 0
        and summary["requests"] > 0
        and summary["terminated"] == summary["requests"]
        and all(summary[k] == 0 for k in GOAL_ZERO)
    )


def records_json(records: list[RunRecord]) -> str:
    return json.dumps([asdict(r) for r in records], indent=1)
