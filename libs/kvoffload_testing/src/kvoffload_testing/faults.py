"""Seeded fault injection against the real stack on loopback — the runs behind
``kvoffload bench faults`` and ``tests/integration/test_faults.py``.

One *run*: a few concurrent client requests (prompts of different lengths, streaming or not) go
through the proxy; at a random moment, 0.05-0.8 s after the first request was sent, one fault hits a
service (kill -9 the decode mid-pull, the prefill mid-layer, the metastore or the proxy; stop the
decode briefly (delayed READ_DONE) or past the peer timeout (lost READ_DONE); stop the prefill past
the peer timeout; stop it past the metastore's heartbeat timeout so its pool and leases expire;
overfill the decode). A fault must hit a request in flight: when every request has ended before that
moment, the longest prompt joins the run and the fault goes in as soon as its client has sent it.
Then every killed service is restarted, and the run records:

- which requests were open when the fault went in, as their clients saw them (sent, not yet
  answered; ``fault_tally.open_at``): a run with none is a missed fault (``missed_faults``, goal 0;
  the two load faults, overfill_decode and fill_host_pool, are their requests and inject nothing at
  that moment: theirs says their requests were in flight together);
- whether each request ended (success or error) within its deadline, and how long it took;
- whether each success returned exactly the oracle's greedy tokens (``kvoffload_testing.oracle``: the
  plain full-KV path, none of the stack's machinery), and whether
  each failure got the error its fault gives (``kvoffload_testing.fault_catalog``: the fault's status, and
  a message naming the service it hit; any 50x is not enough);
- what is still held once the system is idle again: prefill slots, decode pool bytes and
  sequences, pool and metastore leases, open ledger entries (polled until zero or a timeout;
  ``kvoffload_testing.fault_tally`` counts them and sums the runs);
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

import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvcore.transferregistry import EMBEDDED
from kvoffload_testing.fault_catalog import FAULTS_BY_POOL, MAX_TOKENS, SERVER_FAULTS, peer_names, wrong_error
from kvoffload_testing.fault_catalog import request as _request  # the suite's client (tests import it from here)
from kvoffload_testing.fault_tally import (
    MissingStatsKey,
    RequestRecord,
    RunRecord,
    goals_met,
    held,
    log_sizes,
    logged_since,
    open_at,
    summarize,
)
from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.stack import Stack, StackConfig
from kvoffload_testing.stack_client import healthy, stack_stats
from kvoffload_testing.stack_config import ensure_tiny_model

PEER_TIMEOUT_S = 2.0
POOL_TIMEOUT_MS = 3000  # the metastore's heartbeat timeout for pools
REQUEST_DEADLINE_S = 45.0  # a client request must end (either way) within this
BLOCK_SIZE = 16
RECOVERY_S = 60.0  # after a restart every prefill reports ready within this (a new master: objects put again)
PREFILL_POOL_GB = 0.006  # ~2680 tokens of the tiny model: the longest prompt fits, FILLER_TOKENS does not
FILLER_TOKENS = 3200
INJECT_AFTER_S = (0.05, 0.8)  # the fault goes in this long after the run's first request was sent


def fault_stack_config(model: Path, log_dir: Path, pool: str = "kvoffload", transfer: str = EMBEDDED) -> StackConfig:
    """A one-prefill, one-decode stack with short failure bounds, on ports free now (two fault
    stacks may run at once); ``pool`` is the prefill's host-pool backend ("kvoffload": indexed by a
    metastore; "mooncake": on Mooncake Store, a real mooncake_master), ``transfer`` the P→D pull's
    transfer_backend (one of ``kvcore.transferregistry.STACK_TRANSFERS``: "kvoffload", or "mooncake":
    over Mooncake Transfer Engine)."""
    if pool not in FAULTS_BY_POOL:
        raise ValueError(f"pool: got {pool!r}; the fault suite runs on {', '.join(map(repr, FAULTS_BY_POOL))}")
    t = str(PEER_TIMEOUT_S)
    metastore = {"metastore": ["--heartbeat-timeout-ms", str(POOL_TIMEOUT_MS)]} if pool == "kvoffload" else {}
    return StackConfig(
        model=model,
        log_dir=log_dir,
        **free_stack_ports(mooncake=pool == "mooncake"),
        max_model_len=4096,
        block_size=BLOCK_SIZE,
        prefill_pool_gb=PREFILL_POOL_GB,
        pool=pool,
        transfer=transfer,
        service_args={
            **metastore,
            "decode-0": [
                "--peer-timeout-s",
                t,
                "--max-queued-requests",
                "8",
                "--max-num-seqs",
                "4",
                "--metaserver-timeout-s",
                "30",
            ],
            "prefill-0": ["--peer-timeout-s", t, "--read-timeout-s", "15"],
            "proxy": ["--request-timeout-s", "30", "--metaserver-timeout-s", "10", "--connect-timeout-s", "2"],
        },
    )


def _prompts() -> list[list[int]]:
    from dsamodel.tokenizer import ByteTokenizer

    text = "".join(chr(32 + (i * 7919) % 90) for i in range(2400))
    return [ByteTokenizer().encode(text[:n], add_bos=True) for n in (24, 700, 2400)]


def _filler() -> list[int]:
    """A prompt longer than the prefill's host pool holds (the others are prefixes of one text, so
    their blocks are shared)."""
    return [1] + [7 + i % 250 for i in range(FILLER_TOKENS)]


LOG_LINES_KEPT = 12  # per service, of a run with a problem (RunRecord.logs)


class FaultRunner:
    """Runs seeded fault runs against ``stack``; ``reference(prompt)`` gives the expected tokens."""

    def __init__(
        self,
        stack: Stack,
        reference: Callable[[list[int]], list[int]],
        seed: int = 0,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.stack, self.reference, self.seed, self.rng = stack, reference, seed, random.Random(seed)
        self.pool = stack.cfg.pool
        self.faults = FAULTS_BY_POOL[self.pool]
        # restart order = the stack's start order: dependencies first (the metastore or the
        # mooncake_master, then the decode, the prefill, the proxy)
        self.services = [name for name, _, _ in stack.commands()]
        self.prompts = _prompts()
        self.log = log or (lambda msg: None)
        self.names = peer_names(stack.cfg)
        self._t_run = time.monotonic()  # the current run's start: its records' times count from it
        self._moved = threading.Condition()  # a client of the current run sent its request or ended

    def run_many(self, n: int, faults: list[str] | None = None, budget_s: float | None = None) -> list[RunRecord]:
        """``faults`` in order, or ``n`` kinds drawn by weight. With ``budget_s``, no run starts once the
        time spent plus the longest run so far passes it: the runs done by then are returned, fewer
        than planned, and the log says how far it got."""
        names = list(self.faults)
        weights = [self.faults[f] for f in names]
        unknown = [f for f in faults or () if f not in self.faults]
        if unknown:
            raise ValueError(f"faults {unknown} do not apply to a {self.pool!r} stack; its faults: {names}")
        plan = faults if faults is not None else self.rng.choices(names, weights, k=n)
        records: list[RunRecord] = []
        t0 = time.monotonic()
        for i, fault in enumerate(plan):
            longest = max((r.seconds for r in records), default=0.0)
            if budget_s is not None and time.monotonic() - t0 + longest > budget_s:
                self.log(f"the time budget of {budget_s:.0f} s ends after {i} of {len(plan)} runs")
                break
            rec = self.run_one(i, fault)
            self.log(
                f"run {i} {fault}: {sum(r.ok for r in rec.requests)}/{len(rec.requests)} ok, "
                f"open at injection {rec.open_at_injection}, "
                f"max {max((r.seconds for r in rec.requests), default=0):.1f} s, leaks {rec.leaks}, "
                f"fresh {'ok' if rec.fresh_ok else 'FAILED'}"
            )
            records.append(rec)
        return records

    def run_one(self, index: int, fault: str) -> RunRecord:
        rng, stack = self.rng, self.stack
        rec = RunRecord(index, fault)
        self._t_run = t_run = time.monotonic()
        paths = {name: stack.cfg.log_path(name) for name in self.services}
        log_starts = log_sizes(paths)
        picks = self._draw(fault)
        delay = rng.uniform(*INJECT_AFTER_S)
        longer = (self.prompts[-1], rng.random() < 0.5)  # drawn every run: a seed replays the same draws
        records = [RequestRecord(len(p), s) for p, s in picks]
        threads = [self._start(p, s, r, fault) for (p, s), r in zip(picks, records, strict=True)]
        if not self._await_open(records, delay) and fault != "none":
            # every request ended before the moment: the longest prompt joins, the fault goes in once it is sent
            self.log(f"run {index} {fault}: no request open {delay:.2f} s after the first was sent; one more")
            records.append(RequestRecord(len(longer[0]), longer[1]))
            threads.append(self._start(*longer, records[-1], fault))
            self._await_open(records[-1:], 0.0)
        rec.injected_s = time.monotonic() - t_run
        self._inject(fault)
        for th in threads:
            th.join(REQUEST_DEADLINE_S + 5)
        rec.requests = records
        rec.open_at_injection = open_at(records, rec.injected_s)
        self._recover()
        rec.leaks = self._wait_idle()
        ok, tokens, err = _request(stack.url, self.prompts[0], False, REQUEST_DEADLINE_S)
        rec.fresh_ok = ok and tokens == self.reference(self.prompts[0])
        if not rec.fresh_ok:
            self.log(f"run {index}: fresh request failed: {err or tokens}")
        rec.seconds = time.monotonic() - t_run
        if rec.has_problem():
            rec.logs = logged_since(paths, log_starts, LOG_LINES_KEPT)
        return rec

    def _draw(self, fault: str) -> list[tuple[list[int], bool]]:
        """The run's requests: (prompt, stream) each."""
        rng = self.rng
        count = 4 if fault == "overfill_decode" else rng.randint(1, 3)
        picks = [(rng.choice(self.prompts), rng.random() < 0.5) for _ in range(count)]
        if fault == "overfill_decode":  # more long prompts than the decode has sequence slots
            picks = [(self.prompts[-1], False)] * 6
        if fault == "fill_host_pool":  # one prompt the prefill's host pool cannot hold, among others
            picks.append((_filler(), rng.random() < 0.5))
        return picks

    def _start(self, prompt: list[int], stream: bool, rec: RequestRecord, fault: str) -> threading.Thread:
        th = threading.Thread(target=self._client, args=(prompt, stream, rec, fault), daemon=True)
        th.start()
        return th

    def _await_open(self, records: list[RequestRecord], delay_s: float) -> bool:
        """Wait until one of ``records`` has been sent (or all ended), then until ``delay_s`` after the
        first send, unless every one of them ended before; whether one is open at the end."""

        def sent() -> list[float]:
            return [r.sent_s for r in records if r.sent_s is not None]

        def ended() -> bool:
            return all(r.done_s is not None for r in records)

        with self._moved:
            self._moved.wait_for(lambda: bool(sent()) or ended(), REQUEST_DEADLINE_S)
            if sent():
                moment = self._t_run + min(sent()) + delay_s
                self._moved.wait_for(ended, max(0.0, moment - time.monotonic()))
            return bool(open_at(records, time.monotonic() - self._t_run))

    def _mark(self, rec: RequestRecord, moment: str, t_run: float) -> None:
        """Record now, from its run's start ``t_run``, as ``rec``'s ``moment`` ("sent_s" or "done_s")."""
        with self._moved:
            setattr(rec, moment, time.monotonic() - t_run)
            self._moved.notify_all()

    def _client(self, prompt: list[int], stream: bool, rec: RequestRecord, fault: str) -> None:
        t_run = self._t_run  # its run's start: a client that outlives its run must not use the next one's
        t = time.monotonic()
        try:
            ok, tokens, err = _request(
                self.stack.url, prompt, stream, REQUEST_DEADLINE_S, MAX_TOKENS, lambda: self._mark(rec, "sent_s", t_run)
            )
        finally:
            self._mark(rec, "done_s", t_run)
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
                self.log(f"WRONG TOKENS under {fault}: prompt {len(prompt)} stream {stream}: got {tokens}, want {want}")

    def _inject(self, fault: str) -> None:
        s, rng = self.stack, self.rng
        if fault == "none":
            return
        if fault.startswith("kill_"):
            name = {"kill_decode": "decode-0", "kill_prefill": "prefill-0", "kill_proxy": "proxy", **SERVER_FAULTS}[
                fault
            ]
            s.signal(name, signal.SIGKILL)
            s.process(name).wait(10)  # gone for good before anyone restarts it
            return
        stalls = {
            "stall_decode_short": ("decode-0", rng.uniform(0.2, 1.0)),
            "stall_decode_long": ("decode-0", PEER_TIMEOUT_S + rng.uniform(1.0, 2.0)),
            "stall_prefill_long": ("prefill-0", PEER_TIMEOUT_S + rng.uniform(1.0, 2.0)),
            "expire_pool_and_leases": ("prefill-0", POOL_TIMEOUT_MS / 1000 + 1.5),
        }
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
                    raise TimeoutError(
                        f"the prefill on port {port} is not ready {RECOVERY_S:.0f} s after the "
                        f"restarts; see {cfg.log_dir}"
                    )
                time.sleep(0.2)

    def _wait_idle(self, timeout_s: float = 20.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                leaks = held(stack_stats(self.stack.cfg), self.pool)
            except MissingStatsKey:  # the tally and the services disagree: asking again cannot help
                raise
            except Exception as exc:  # noqa: BLE001 - a service still coming up fails in many ways: ask again
                leaks = {"stats_error": 1.0}
                self.log(f"stats: {exc!r}")
            if not any(leaks.values()) or time.monotonic() > deadline:
                return leaks
            time.sleep(0.25)


def reference_tokens(model_dir: Path) -> Callable[[list[int]], list[int]]:
    """The oracle's greedy tokens (``kvoffload_testing.oracle``: the plain full-KV path, none of the
    stack's machinery) of ``MAX_TOKENS`` after a prompt, within the fault stack's max_model_len (cached)."""
    from kvoffload_testing.oracle import greedy_reference

    run = greedy_reference(model_dir, block_size=BLOCK_SIZE, max_model_len=4096)
    return lambda prompt: run(prompt, MAX_TOKENS)


def bench(
    runs: int = 20, seed: int = 0, progress: bool = True, pool: str = "kvoffload", transfer: str = EMBEDDED
) -> dict:
    """``kvoffload bench faults``: ``runs`` seeded fault runs on a fresh loopback stack whose
    prefill pool is ``pool`` ("kvoffload" or "mooncake") and whose P→D pull runs on ``transfer`` (one
    of ``kvcore.transferregistry.STACK_TRANSFERS``)."""
    from svcruntime.logs import quiet_logs

    quiet_logs()  # stdout carries the JSON only
    with tempfile.TemporaryDirectory(prefix="kvoffload-faults-") as tmp:
        model = ensure_tiny_model(Path(tmp) / "tiny")
        cfg = fault_stack_config(model, Path(tmp) / "logs", pool, transfer)
        ref = reference_tokens(model)
        for p in _prompts():
            ref(p)
        with Stack(cfg) as stack:
            out = bench_runs(FaultRunner(stack, ref, seed), runs, progress)
    out["pool"], out["transfer"] = pool, transfer
    return out


def bench_runs(runner: FaultRunner, runs: int, progress: bool = False) -> dict:
    """The bench's runs on ``runner``'s stack: every fault kind once (as far as ``runs`` allows),
    then kinds drawn by weight; their summary, its seed, each goal (``goals_met``: ``missed_faults``
    0, nothing leaked, ...) and whether all are met (``goal_met``)."""
    import sys

    from tqdm import tqdm

    faults = runner.faults
    names = list(faults)
    plan = (names + runner.rng.choices(names, [faults[f] for f in names], k=max(0, runs - len(names))))[:runs]
    records = [
        runner.run_one(i, fault)
        for i, fault in enumerate(tqdm(plan, desc="fault runs", disable=not progress, file=sys.stderr))
    ]
    out = summarize(records, faults)
    out["seed"] = runner.seed
    out["goals_met"] = goals_met(out)
    out["goal_met"] = all(out["goals_met"].values())
    return out
