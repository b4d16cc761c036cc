"""Seeded fault injection against the real stack on loopback — the runs behind
``kvoffload bench faults`` and ``tests/integration/test_faults.py``.

One *run*: a few concurrent client requests (prompts of different lengths, streaming or not) go
through the proxy; at a random moment one fault hits a service (kill -9 the decode mid-pull, the
prefill mid-layer, the metastore or the proxy; stop the decode briefly (delayed READ_DONE) or past
the peer timeout (lost READ_DONE); stop the prefill past the peer timeout; stop it past the
metastore's heartbeat timeout so its pool and leases expire; overfill the decode). Then every
killed service is restarted, and the run records:

- whether each request ended (success or error) within its deadline, and how long it took;
- whether each success returned exactly the oracle's greedy tokens (``kvoffload.reference``: the
  plain full-KV path, none of the stack's machinery), and whether
  each failure got the error its fault gives (``EXPECTED_ERRORS``: the fault's status, and a message
  naming the service it hit; any 50x is not enough);
- what is still held once the system is idle again: prefill slots, decode pool bytes and
  sequences, pool and metastore leases, open ledger entries (polled until zero or a timeout);
- whether a fresh request then succeeds with the right tokens.

The stack runs with short bounds (peer timeout 2 s) so a run takes seconds, not minutes.

The same suite runs on a stack whose prefill pool is on Mooncake Store (``pool="mooncake"``: a real
``mooncake_master`` in place of the metastore), with that stack's faults (``MOONCAKE_FAULTS``): kill -9
of the master (every key is lost; the prefill reports not ready until it has put its objects again)
and kill -9 of the prefill, which leaves a dead segment owner behind: the master lists the dead
process's objects until its client_ttl, and the restarted prefill meets them on its next prefix hit:
the objects are removed from the store and that request computes the prefix again (it succeeds).
"""

from __future__ import annotations

import http.client
import json
import random
import re
import signal
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvoffload.stack import (DATA_PORT_OFFSET, MOONCAKE_MASTER, Stack, StackConfig, healthy, ensure_tiny_model,
                             free_stack_ports, stack_stats)

PEER_TIMEOUT_S = 2.0
POOL_TIMEOUT_MS = 3000  # the metastore's heartbeat timeout for pools
REQUEST_DEADLINE_S = 45.0  # a client request must end (either way) within this
BLOCK_SIZE = 16
MAX_TOKENS = 6

# fault -> relative weight in a randomized run
FAULTS: dict[str, int] = {
    "none": 1,
    "kill_decode": 2,
    "kill_prefill": 2,
    "kill_metastore": 1,
    "kill_proxy": 1,
    "stall_decode_short": 2,
    "stall_decode_long": 2,
    "stall_prefill_long": 2,
    "expire_pool_and_leases": 1,
    "overfill_decode": 1,
    "fill_host_pool": 1,
}
# the faults of a stack whose prefill pool is on Mooncake Store: no metastore to kill or to let the
# pool expire at; its master instead, and kill_prefill leaves a dead segment owner (module docstring)
MOONCAKE_FAULTS: dict[str, int] = {
    "none": 1,
    "kill_decode": 2,
    "kill_prefill": 2,
    "kill_mooncake_master": 2,
    "kill_proxy": 1,
    "stall_decode_short": 1,
    "stall_decode_long": 1,
    "stall_prefill_long": 1,
    "overfill_decode": 1,
    "fill_host_pool": 1,
}
FAULTS_BY_POOL = {"kvoffload": FAULTS, "mooncake": MOONCAKE_FAULTS}
RECOVERY_S = 60.0  # after a restart every prefill reports ready within this (a new master: objects put again)
PREFILL_POOL_GB = 0.006  # ~2680 tokens of the tiny model: the longest prompt fits, FILLER_TOKENS does not
FILLER_TOKENS = 3200


def fault_stack_config(model: Path, log_dir: Path, pool: str = "kvoffload") -> StackConfig:
    """A one-prefill, one-decode stack with short failure bounds, on ports free now (two fault
    stacks may run at once); ``pool`` is the prefill's host-pool backend ("kvoffload": indexed by a
    metastore; "mooncake": on Mooncake Store, a real mooncake_master)."""
    if pool not in FAULTS_BY_POOL:
        raise ValueError(f"pool: got {pool!r}; the fault suite runs on {', '.join(map(repr, FAULTS_BY_POOL))}")
    t = str(PEER_TIMEOUT_S)
    metastore = {"metastore": ["--heartbeat-timeout-ms", str(POOL_TIMEOUT_MS)]} if pool == "kvoffload" else {}
    return StackConfig(
        model=model, log_dir=log_dir, **free_stack_ports(mooncake=pool == "mooncake"), max_model_len=4096,
        block_size=BLOCK_SIZE, prefill_pool_gb=PREFILL_POOL_GB, pool=pool,
        service_args={
            **metastore,
            "decode-0": ["--peer-timeout-s", t, "--max-queued-requests", "8", "--max-num-seqs", "4",
                         "--metaserver-timeout-s", "30"],
            "prefill-0": ["--peer-timeout-s", t, "--read-timeout-s", "15"],
            "proxy": ["--request-timeout-s", "30", "--metaserver-timeout-s", "10", "--connect-timeout-s", "2"],
        })


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


def _prompts() -> list[list[int]]:
    from dsamodel.tokenizer import ByteTokenizer

    text = "".join(chr(32 + (i * 7919) % 90) for i in range(2400))
    return [ByteTokenizer().encode(text[:n], add_bos=True) for n in (24, 700, 2400)]


def _filler() -> list[int]:
    """A prompt longer than the prefill's host pool holds (the others are prefixes of one text, so
    their blocks are shared)."""
    return [1] + [7 + i % 250 for i in range(FILLER_TOKENS)]


def _request(url: str, prompt: list[int], stream: bool, deadline_s: float) -> tuple[bool, list[int], str]:
    """(ok, tokens, error) of one completion; an error event mid-stream is a failure. The error says
    its status first ("HTTP 502: <body>", "SSE error 502: <message>"; ``error_status`` reads it)
    or, with no HTTP answer, the exception ("RemoteDisconnected: ...")."""
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=deadline_s) as resp:
            if not stream:
                out = json.loads(resp.read())
                return True, out["choices"][0]["token_ids"], ""
            ids: list[int] = []
            for raw in resp:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    return True, ids, ""
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return False, ids, _sse_error(event["error"])
                for choice in event["choices"]:
                    ids.extend(choice.get("token_ids", []))
            return False, ids, "the stream ended without data: [DONE] (truncated)"
    except urllib.error.HTTPError as exc:
        return False, [], f"HTTP {exc.code}: {exc.read()[:ERROR_CHARS].decode(errors='replace')}"
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        return False, [], f"{type(exc).__name__}: {exc}"


ERROR_CHARS = 2000  # of an error body: enough for the proxy's message and the backend's it quotes


def _sse_error(error: object) -> str:
    """An SSE error event's error object as "SSE error <code>: <message>" (no code: "SSE error: ...")."""
    if not isinstance(error, dict):
        return f"SSE error: {error}"
    code = error.get("code")
    return f"SSE error{f' {code}' if isinstance(code, int) else ''}: {error.get('message', error)}"


def error_status(error: str) -> int | None:
    """The HTTP status an error of ``_request`` carries (an SSE error event's code), None when the
    request got no HTTP answer (the connection broke)."""
    m = re.match(r"(?:HTTP|SSE error) (\d{3})\b", error)
    return int(m.group(1)) if m else None


# ---- the error each fault may give ----------------------------------------------------------------

@dataclass(frozen=True)
class ExpectedError:
    """What a request that ``fault`` failed must have been told: one of ``statuses`` (None: no HTTP
    answer, the client's connection broke) and a message that names ``peer``, the service the fault
    hit, the way the proxy and the services name it (``peer_names``), and says ``says`` when set.
    No statuses: the fault must fail no request."""

    statuses: frozenset[int | None] = frozenset()
    peer: str = ""
    says: str = ""


# What each fault gives, read off how the proxy and the services fail (services/proxy upstream.py,
# flow.py; the decode's app.py and watchdog; the prefill's worker; pdlink's links):
# - a dead decode: the proxy's 502 "decoder <url> failed while sending the request / relaying the
#   response" (an SSE error once streaming), or 503 "no decoder reachable"; or the prefill's 502 about
#   its peer ("decode <host:port> no longer waits", "the decode did not read layer(s)"), relayed as
#   "prefiller <url> answered HTTP 502";
# - a dead prefill: 502 "prefiller <url> failed while running the prefill" / 503 "no prefiller
#   reachable", or the decode's watchdog, "prefill <host:port> sent no news", relayed as 502;
# - a dead metastore: the prefill's 502 "prefill failed: MetaStore <call>: UNAVAILABLE";
# - a dead proxy: no HTTP answer, the connection breaks;
# - a decode stopped past the peer timeout: the prefill's 502 (its reads not done); a prefill
#   stopped past it (and past the pool's heartbeat timeout): the decode's watchdog, 502;
# - more requests than the decode's queue holds: 429 "every decoder is at its queue limit";
# - a prompt the prefill's host pool cannot hold: the prefill's 502 "host pool full";
# - a dead mooncake_master: the prefill's 502 naming Mooncake's failed call ("Mooncake Store exists
#   failed ... the master does not answer").
EXPECTED_ERRORS: dict[str, ExpectedError] = {
    "none": ExpectedError(),
    "stall_decode_short": ExpectedError(),  # READ_DONE only delayed: nothing fails
    "kill_decode": ExpectedError(frozenset({502, 503}), "decode"),
    "kill_prefill": ExpectedError(frozenset({502, 503}), "prefill"),
    "kill_metastore": ExpectedError(frozenset({502}), "metastore"),
    "kill_mooncake_master": ExpectedError(frozenset({502}), "mooncake"),
    "kill_proxy": ExpectedError(frozenset({None}), "proxy"),
    "stall_decode_long": ExpectedError(frozenset({502}), "decode"),
    "stall_prefill_long": ExpectedError(frozenset({502}), "prefill"),
    "expire_pool_and_leases": ExpectedError(frozenset({502}), "prefill"),
    "overfill_decode": ExpectedError(frozenset({429}), "decode", "queue limit"),
    "fill_host_pool": ExpectedError(frozenset({502}), "prefill", "host pool full"),
}


def peer_names(cfg: StackConfig) -> dict[str, tuple[str, ...]]:
    """How errors name each service of a one-prefill, one-decode stack ``cfg``: the proxy names a
    backend by role and URL ("decoder http://host:port"; "every decoder" when all refused), the
    services their peers by role and gRPC address ("prefill host:data_port", "decode
    host:control_port") or role ("the decode did not read ..."); the metastore and Mooncake are
    named by name. A broken connection to the proxy is named by the exception that says so."""
    h, prefill, decode = cfg.host, cfg.prefill_ports[0], cfg.decode_ports[0]
    return {
        "decode": (f"http://{h}:{decode}", f"decode {h}:{cfg.decode_control_port(0)}", "the decode ",
                   "every decoder "),
        "prefill": (f"http://{h}:{prefill}", f"prefill {h}:{prefill + DATA_PORT_OFFSET}", "the prefill "),
        "metastore": ("MetaStore", "metastore"),
        "mooncake": ("Mooncake", "mooncake"),
        "proxy": ("RemoteDisconnected", "ConnectionResetError", "ConnectionRefusedError", "Connection refused",
                  "IncompleteRead", "BrokenPipeError", "the stream ended without data: [DONE]"),
    }


def _shown(status: int | None) -> str:
    return "no HTTP answer" if status is None else f"HTTP {status}"


def wrong_error(fault: str, error: str, names: dict[str, tuple[str, ...]]) -> str:
    """Why ``error`` (a failed request's, as ``_request`` wrote it) is not what ``fault`` gives
    (``EXPECTED_ERRORS``); "" when it is. Any 50x is not enough: the status must be the fault's and
    the message must name the service the fault hit."""
    want = EXPECTED_ERRORS[fault]
    status = error_status(error)
    if not want.statuses:
        return f"{fault} must fail no request; this one got {_shown(status)}"
    if status not in want.statuses:
        wanted = " or ".join(sorted(map(_shown, want.statuses)))
        return f"{fault} gives {wanted}, not {_shown(status)}"
    if not any(name in error for name in names[want.peer]):
        return f"{fault}: the error does not name the {want.peer} ({' / '.join(names[want.peer])})"
    if want.says and want.says not in error:
        return f"{fault}: the error does not say {want.says!r}"
    return ""


LEAK_KEYS = ("leaked_slots", "leaked_pool_bytes", "leaked_leases", "open_requests")

# The Stats counters the tally reads, per kind of service — exactly what each service's GetStats
# always reports (prefill: kvcore.gates + the ledger + the pool; decode: the loop + the ledger + the
# pool; metastore: kvoffload_metastore.metrics.stats_counters). The prefill reports its pool's
# counters only while the pool answers (``pool_available`` 1); ``pool_available`` 0 counts as open.
REQUIRED_STATS: dict[str, tuple[str, ...]] = {
    "prefill": ("held_slots", "ledger_open", "pool_available"),
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
    raise MissingStatsKey(f"Stats of an unknown service {name!r}: the leak tally knows prefill-N, decode-N "
                          f"and metastore")


def _require(name: str, counters: dict[str, float], keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in counters]
    if missing:
        raise MissingStatsKey(f"{name}: Stats lack {', '.join(map(repr, missing))} (the leak tally needs "
                              f"{', '.join(keys)}); the keys present are: {sorted(counters)}")


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
            out["open_requests"] += c["ledger_open"] + (1 - c["pool_available"])
        elif kind == "decode":
            out["leaked_pool_bytes"] += c["pool_used_bytes"]
            out["leaked_leases"] += c["pool_live_leases"]
            out["open_requests"] += c["sequences"] + c["ledger_open"]
        else:
            out["leaked_leases"] += c["live_leases"]
    return out


class FaultRunner:
    """Runs seeded fault runs against ``stack``; ``reference(prompt)`` gives the expected tokens."""

    def __init__(self, stack: Stack, reference: Callable[[list[int]], list[int]], seed: int = 0,
                 log: Callable[[str], None] | None = None) -> None:
        self.stack, self.reference, self.seed, self.rng = stack, reference, seed, random.Random(seed)
        self.pool = stack.cfg.pool
        self.faults = FAULTS_BY_POOL[self.pool]
        # restart order = the stack's start order: dependencies first (the metastore or the
        # mooncake_master, then the decode, the prefill, the proxy)
        self.services = [name for name, _, _ in stack.commands()]
        self.prompts = _prompts()
        self.log = log or (lambda msg: None)
        self.names = peer_names(stack.cfg)

    def run_many(self, n: int, faults: list[str] | None = None) -> list[RunRecord]:
        names = list(self.faults)
        weights = [self.faults[f] for f in names]
        unknown = [f for f in faults or () if f not in self.faults]
        if unknown:
            raise ValueError(f"faults {unknown} do not apply to a {self.pool!r} stack; its faults: {names}")
        plan = faults if faults is not None else self.rng.choices(names, weights, k=n)
        records = []
        for i, fault in enumerate(plan):
            rec = self.run_one(i, fault)
            self.log(f"run {i} {fault}: {sum(r.ok for r in rec.requests)}/{len(rec.requests)} ok, "
                     f"max {max((r.seconds for r in rec.requests), default=0):.1f} s, leaks {rec.leaks}, "
                     f"fresh {'ok' if rec.fresh_ok else 'FAILED'}")
            records.append(rec)
        return records

    def run_one(self, index: int, fault: str) -> RunRecord:
        rng, stack = self.rng, self.stack
        rec = RunRecord(index, fault)
        t_run = time.monotonic()
        count = 4 if fault == "overfill_decode" else rng.randint(1, 3)
        picks = [(rng.choice(self.prompts), rng.random() < 0.5) for _ in range(count)]
        if fault == "overfill_decode":  # more long prompts than the decode has sequence slots
            picks = [(self.prompts[-1], False)] * 6
        if fault == "fill_host_pool":  # one prompt the prefill's host pool cannot hold, among others
            picks.append((_filler(), rng.random() < 0.5))
        records = [RequestRecord(len(p), s) for p, s in picks]
        threads = [threading.Thread(target=self._client, args=(p, s, r, fault), daemon=True)
                   for (p, s), r in zip(picks, records)]
        for th in threads:
            th.start()
        time.sleep(rng.uniform(0.05, 0.8))
        self._inject(fault)
        for th in threads:
            th.join(REQUEST_DEADLINE_S + 5)
        self._recover()
        rec.requests = records
        rec.leaks = self._wait_idle()
        ok, tokens, err = _request(stack.url, self.prompts[0], False, REQUEST_DEADLINE_S)
        rec.fresh_ok = ok and tokens == self.reference(self.prompts[0])
        if not rec.fresh_ok:
            self.log(f"run {index}: fresh request failed: {err or tokens}")
        rec.seconds = time.monotonic() - t_run
        return rec

    def _client(self, prompt: list[int], stream: bool, rec: RequestRecord, fault: str) -> None:
        t = time.monotonic()
        ok, tokens, err = _request(self.stack.url, prompt, stream, REQUEST_DEADLINE_S)
        rec.seconds = time.monotonic() - t
        rec.ended = rec.seconds <= REQUEST_DEADLINE_S
        rec.ok, rec.error = ok, err
        if not ok:
            rec.wrong_error = wrong_error(fault, err, self.names)
            if rec.wrong_error:
                self.log(f"WRONG ERROR under {fault}: {rec.wrong_error}: {err[:500]}")
        elif len(prompt) > FILLER_TOKENS:
            rec.tokens_equal = False  # it cannot fit: success would mean the pool bound is not enforced
            self.log(f"the {len(prompt)}-token filler succeeded under {fault}")
        else:
            want = self.reference(prompt)
            rec.tokens_equal = tokens == want
            if not rec.tokens_equal:
                self.log(f"WRONG TOKENS under {fault}: prompt {len(prompt)} stream {stream}: got {tokens}, "
                         f"want {want}")

    def _inject(self, fault: str) -> None:
        s, rng = self.stack, self.rng
        if fault == "none":
            return
        if fault.startswith("kill_"):
            name = {"kill_decode": "decode-0", "kill_prefill": "prefill-0", "kill_metastore": "metastore",
                    "kill_mooncake_master": MOONCAKE_MASTER, "kill_proxy": "proxy"}[fault]
            s.signal(name, signal.SIGKILL)
            s.process(name).wait(10)  # gone for good before anyone restarts it
            return
        stalls = {"stall_decode_short": ("decode-0", rng.uniform(0.2, 1.0)),
                  "stall_decode_long": ("decode-0", PEER_TIMEOUT_S + rng.uniform(1.0, 2.0)),
                  "stall_prefill_long": ("prefill-0", PEER_TIMEOUT_S + rng.uniform(1.0, 2.0)),
                  "expire_pool_and_leases": ("prefill-0", POOL_TIMEOUT_MS / 1000 + 1.5)}
        if fault in stalls:
            name, seconds = stalls[fault]
            s.signal(name, signal.SIGSTOP)
            try:
                time.sleep(seconds)
            finally:
                s.signal(name, signal.SIGCONT)

    def _recover(self) -> None:
        """Resume anything stopped, restart anything dead (dependencies first), then wait until every
        prefill reports ready (a restarted metastore or master: the pool registered or its objects
        put again), so the run's fresh request meets a stack that is whole again."""
        for name in self.services:
            self.stack.signal(name, signal.SIGCONT)
        for name in self.services:
            self.stack.restart(name)
        cfg = self.stack.cfg
        deadline = time.monotonic() + RECOVERY_S
        for port in cfg.prefill_ports:
            while not healthy(f"http://{cfg.host}:{port}/health"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the prefill on port {port} is not ready {RECOVERY_S:.0f} s after the "
                                       f"restarts; see {cfg.log_dir}")
                time.sleep(0.2)

    def _wait_idle(self, timeout_s: float = 20.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                leaks = held(stack_stats(self.stack.cfg), self.pool)
            except MissingStatsKey:  # the tally and the services disagree: asking again cannot help
                raise
            except Exception as exc:  # a service still coming up: ask again
                leaks = {"stats_error": 1.0}
                self.log(f"stats: {exc!r}")
            if not any(leaks.values()) or time.monotonic() > deadline:
                return leaks
            time.sleep(0.25)


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


def reference_tokens(model_dir: Path) -> Callable[[list[int]], list[int]]:
    """The oracle's greedy tokens (``kvoffload.reference``: the plain full-KV path, none of the
    stack's machinery) of ``MAX_TOKENS`` after a prompt, within the fault stack's max_model_len (cached)."""
    from kvoffload.reference import greedy_reference

    run = greedy_reference(model_dir, block_size=BLOCK_SIZE, max_model_len=4096)
    return lambda prompt: run(prompt, MAX_TOKENS)


def bench(runs: int = 20, seed: int = 0, progress: bool = True, pool: str = "kvoffload") -> dict:
    """``kvoffload bench faults``: ``runs`` seeded fault runs on a fresh loopback stack whose
    prefill pool is ``pool`` ("kvoffload" or "mooncake")."""
    from dsamodel.bench import quiet_logs

    quiet_logs()  # stdout carries the JSON only
    with tempfile.TemporaryDirectory(prefix="kvoffload-faults-") as tmp:
        model = ensure_tiny_model(Path(tmp) / "tiny")
        cfg = fault_stack_config(model, Path(tmp) / "logs", pool)
        ref = reference_tokens(model)
        for p in _prompts():
            ref(p)
        with Stack(cfg) as stack:
            out = bench_runs(FaultRunner(stack, ref, seed), runs, progress)
    out["pool"] = pool
    return out


def bench_runs(runner: FaultRunner, runs: int, progress: bool = False) -> dict:
    """The bench's runs on ``runner``'s stack: every fault kind once (as far as ``runs`` allows),
    then kinds drawn by weight; their summary, its seed and whether the goal is met."""
    import sys

    from tqdm import tqdm

    faults = runner.faults
    names = list(faults)
    plan = (names + runner.rng.choices(names, [faults[f] for f in names], k=max(0, runs - len(names))))[:runs]
    records = [runner.run_one(i, fault)
               for i, fault in enumerate(tqdm(plan, desc="fault runs", disable=not progress, file=sys.stderr))]
    out = summarize(records, faults)
    out["seed"] = runner.seed
    out["goal_met"] = goal_met(out)
    return out


# the figures of ``summarize`` that must be 0 for the suite's goal: nothing held or open once the
# stack is idle (and its Stats read), every answer right, every error its fault's own, every fresh
# request after a run served
GOAL_ZERO = ("stats_unreadable", "leaked_slots", "leaked_pool_bytes", "leaked_leases", "open_requests_after",
             "wrong_tokens", "wrong_errors", "fresh_request_failures")


class MissingFigure(LookupError):
    """A figure the goal is judged on is not in the summary: it was not measured, so no pass."""


def goal_met(summary: dict) -> bool:
    """Whether ``summary`` (``summarize``'s) meets the fault suite's goal: runs and requests took
    place, every request ended within its deadline, and every ``GOAL_ZERO`` figure is 0. A figure
    the summary lacks raises ``MissingFigure`` naming it."""
    missing = [k for k in ("runs", "requests", "terminated", *GOAL_ZERO) if k not in summary]
    if missing:
        raise MissingFigure(f"the fault summary lacks {', '.join(missing)}; it has {sorted(summary)}")
    return (summary["runs"] > 0 and summary["requests"] > 0 and summary["terminated"] == summary["requests"]
            and all(summary[k] == 0 for k in GOAL_ZERO))


def records_json(records: list[RunRecord]) -> str:
    return json.dumps([asdict(r) for r in records], indent=1)
