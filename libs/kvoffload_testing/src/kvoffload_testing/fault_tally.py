"""The fault suite's tally: what each run recorded, what an idle stack still holds, the summary over
the runs and the goal it judges.

``held`` reads the services' Stats counters (``REQUIRED_STATS``: exactly what each service always
reports; a missing one raises ``MissingStatsKey``, never counts as 0); ``open_at`` says which
requests were open (sent, not yet answered, as the client saw them) at the moment a fault went in,
and a run whose fault found none is a *missed* fault (``missed``: not recorded counts as missed);
``summarize`` sums the runs' figures; ``goals_met`` judges each goal (every ``GOAL_ZERO`` figure,
``missed_faults`` among them, at 0; a figure the summary lacks raises ``MissingFigure``) and
``goal_met`` all of them. ``log_sizes`` / ``logged_since``: the warnings and errors a run's services
logged, for the report of a run with a problem.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
    # seconds from the run's start: when the client had written the whole request (None: never sent,
    # e.g. the connection was refused) and when it had the whole answer or its error (None: not yet)
    sent_s: float | None = None
    done_s: float | None = None


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
    # seconds from the run's start to the fault's injection, and the requests (indices into
    # ``requests``) open then (``open_at``); None: not recorded, which counts as a missed fault
    injected_s: float | None = None
    open_at_injection: list[int] | None = None

    def has_problem(self) -> bool:
        """The fresh request failed, something leaked, or a request did not end, got wrong tokens or
        the wrong error."""
        return (
            not self.fresh_ok
            or any(v for v in self.leaks.values())
            or any(not q.ended or q.tokens_equal is False or (not q.ok and q.wrong_error != "") for q in self.requests)
        )


def open_at(requests: list[RequestRecord], t_s: float) -> list[int]:
    """The indices of ``requests`` open at ``t_s`` (seconds from the run's start), as their client saw
    them: sent by then and not yet answered (``done_s`` later, or None: it never ended)."""
    return [
        i
        for i, r in enumerate(requests)
        if r.sent_s is not None and r.sent_s <= t_s and (r.done_s is None or r.done_s > t_s)
    ]


def missed(run: RunRecord) -> bool:
    """Whether ``run``'s fault touched no request: none was open at its injection, or what was open was
    not recorded. A run of fault "none" injects nothing, so it cannot miss."""
    return run.fault != "none" and not run.open_at_injection


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
        # runs whose fault went in while no request was open: it proved nothing
        "missed_faults": sum(missed(run) for run in records),
        "leaked_slots": _leak_total(leaks, "leaked_slots"),
        "leaked_pool_bytes": _leak_total(leaks, "leaked_pool_bytes"),
        "leaked_leases": _leak_total(leaks, "leaked_leases"),
        "open_requests_after": _leak_total(leaks, "open_requests") + unreadable,
        "stats_unreadable": unreadable,  # runs whose idle Stats could not be read: leaks unknown
        "fresh_request_failures": sum(not run.fresh_ok for run in records),
        "max_termination_s": round(max((r.seconds for r in reqs), default=0.0), 3),
        "faults": {f: sum(run.fault == f for run in records) for f in faults},
    }


# the figures of ``summarize`` that must be 0 for the suite's goal: every fault hit an open request,
# nothing held or open once the stack is idle (and its Stats read), every answer right, every error
# its fault's own, every fresh request after a run served
GOAL_ZERO = (
    "missed_faults",
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


def goals_met(summary: dict) -> dict[str, bool]:
    """Each goal of the fault suite on ``summary`` (``summarize``'s), by name: runs and requests took
    place (``runs``, ``requests``), every request ended within its deadline (``terminated``), and
    each ``GOAL_ZERO`` figure is 0. A figure the summary lacks raises ``MissingFigure`` naming it."""
    missing = [k for k in ("runs", "requests", "terminated", *GOAL_ZERO) if k not in summary]
    if missing:
        raise MissingFigure(f"the fault summary lacks {', '.join(missing)}; it has {sorted(summary)}")
    return {
        "runs": summary["runs"] > 0,
        "requests": summary["requests"] > 0,
        "terminated": summary["terminated"] == summary["requests"],
        **{k: summary[k] == 0 for k in GOAL_ZERO},
    }


def goal_met(summary: dict) -> bool:
    """Whether ``summary`` meets every goal of ``goals_met`` (which raises for a missing figure)."""
    return all(goals_met(summary).values())


LOG_LINE_CHARS = 400  # of a warning or error line in a run's report


def log_sizes(paths: dict[str, Path]) -> dict[str, int]:
    """Each service's log size now (0: no log yet): where ``logged_since`` starts reading."""
    return {name: path.stat().st_size if path.exists() else 0 for name, path in paths.items()}


def logged_since(paths: dict[str, Path], starts: dict[str, int], keep: int) -> dict[str, list[str]]:
    """Each service's warnings and errors written to its log (``paths``) since ``starts`` (its sizes
    then; a restarted service appends to the same file): the last ``keep`` lines of each, for a run's
    failure report."""
    out = {}
    for name, start in starts.items():
        path = paths[name]
        if not path.exists():
            continue
        with path.open("rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        lines = [
            ln[:LOG_LINE_CHARS] for ln in text.splitlines() if re.search(r'"level": "(warning|error|critical)"', ln)
        ]
        if lines:
            out[name] = lines[-keep:]
    return out


def records_json(records: list[RunRecord]) -> str:
    return json.dumps([asdict(r) for r in records], indent=1)
