"""DecodeLoop: admission queues instead of failing, cancel frees, partial transfers are refused."""

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsamodel.presets import tiny_model
from kvoffload_decode.admission import DecodeFull
from kvoffload_decode.loop import DecodeLoop
from kvoffload_decode.rows import installed_prefix
from kvoffload_engine import build
from kvoffload_engine.decode import SparseDecoder
from openai_api.sampling_params import SamplingParams


@pytest.fixture()
def loop():
    model = tiny_model(dtype="float32")
    pool = build.decode_pool(model, 16, 8 << 20)
    lp = DecodeLoop(
        SparseDecoder(model, pool, topk_buffer_size=64, max_num_seqs=1, max_model_len=256), model.config.eos_token_id
    )
    yield lp
    lp.close()
    pool.close()


def test_a_full_decode_queues_at_once_and_refuses_past_the_queue_limit(loop):
    """No waiting at admission: with the only sequence slot taken, a second request is queued at once
    (host blocks reserved, no slot); past the queue limit a request is refused with a Retry-After."""
    loop.max_queued = 2
    loop.expect_remote("a", [1, 2, 3], SamplingParams(max_tokens=2), lambda *e: None)
    b = loop.expect_remote("b", [4, 5], SamplingParams(max_tokens=2), lambda *e: None)
    assert b.reserved and loop.decoder.seqs["b"].seq_slot is None  # queued: blocks, no device row
    with pytest.raises(DecodeFull, match="queue is full") as refused:
        loop.expect_remote("c", [6], SamplingParams(max_tokens=2), lambda *e: None)
    assert refused.value.retry_after_s >= 1
    st = loop.stats()
    assert st["queued"] == 2 and st["rejected"] == 1 and st["sequences"] == 2
    assert loop.cancel("a", "test")
    loop.expect_remote("c", [6], SamplingParams(max_tokens=2), lambda *e: None)  # room again
    assert loop.stats()["pending"] == 2


def test_partial_transfer_is_reported_and_complete_prompt_decodes(loop):
    events = []
    done = threading.Event()

    def emit(kind, value):
        events.append((kind, value))
        if kind in ("done", "error"):
            done.set()

    model = loop.decoder.model
    n = 20
    loop.expect_remote("r", list(range(n)), SamplingParams(max_tokens=3), emit)
    c = model.config
    kv = torch.randn(n, c.kv_row_width)
    idx = torch.randn(n, c.index_head_dim)
    for layer in range(len(model.cache_layers) - 1):
        loop.write_rows("r", layer, 0, kv, idx)
    loop.prefill_done("r", n, 7)
    assert "layer 4 has 0 of 20 rows" in loop.check_prompt_complete("r")
    loop.write_rows("r", len(model.cache_layers) - 1, 0, kv, idx)
    assert loop.check_prompt_complete("r") == ""
    assert done.wait(30)
    tokens = [v for k, v in events if k == "token"]
    assert tokens[0] == 7 and len(tokens) == 3 and events[-1] == ("done", "length")
    assert loop.stats()["sequences"] == 0


def test_cancel_during_a_copy_frees_when_the_copy_ends(loop):
    model = loop.decoder.model
    n = 20
    loop.expect_remote("r", list(range(n)), SamplingParams(max_tokens=3), lambda *e: None)
    real = loop.decoder.write_prompt_layer
    started, release = threading.Event(), threading.Event()

    def slow(*args, **kw):
        started.set()
        release.wait(5)
        return real(*args, **kw)

    loop.decoder.write_prompt_layer = slow
    kv = torch.randn(n, model.config.kv_row_width)
    idx = torch.randn(n, model.config.index_head_dim)
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(KeyError, loop.write_rows, "r", 0, 0, kv, idx)))
    t.start()
    assert started.wait(5)
    assert loop.cancel("r", "client left")
    assert loop.stats()["sequences"] == 1  # its blocks stay until the copy into them ends
    release.set()
    t.join(5)
    assert errors and loop.stats()["sequences"] == 0


def test_a_prefill_that_goes_quiet_fails_its_request_and_frees_it():
    """The watchdog: a request whose prefill reported once and then fell silent for longer than
    peer_timeout_s is failed with an error naming the prefill and the stage, and its blocks are
    freed; a request never heard from (still waiting for the proxy's dispatch) is left alone."""
    model = tiny_model(dtype="float32")
    pool = build.decode_pool(model, 16, 8 << 20)
    lp = DecodeLoop(
        SparseDecoder(model, pool, topk_buffer_size=64, max_num_seqs=2, max_model_len=256),
        model.config.eos_token_id,
        peer_timeout_s=0.3,
    )
    try:
        errors = []
        got = threading.Event()
        lp.expect_remote(
            "quiet",
            list(range(20)),
            SamplingParams(max_tokens=2),
            lambda kind, value: (errors.append((kind, value)), got.set()) if kind == "error" else None,
        )
        lp.expect_remote("waiting", list(range(20)), SamplingParams(max_tokens=2), lambda *e: None)
        lp.awaiting_prefill("quiet")
        lp.awaiting_prefill("waiting")
        assert lp.heard_from_prefill("quiet", "prefill 10.0.0.1:18100")
        assert not lp.heard_from_prefill("unknown", "prefill 10.0.0.1:18100")
        assert got.wait(5)
        [(kind, reason)] = errors
        assert "prefill 10.0.0.1:18100" in reason and "'pulling'" in reason, reason
        st = lp.stats()
        assert st["pending"] == 1 and st["sequences"] == 1 and st["ledger_finished_timeout"] == 1
        assert st["ledger_open_awaiting_prefill"] == 1
        assert not lp.heard_from_prefill("quiet", "prefill 10.0.0.1:18100")  # gone: a heartbeat says unknown
    finally:
        lp.close()
        pool.close()


def test_other_threads_get_the_lock_while_a_batch_decodes():
    """The loop thread gives the lock up between steps for real: Stats, admission, pulls and cancels
    from other threads are served while a long generation runs, not after it."""

    model = tiny_model(dtype="float32")
    pool = build.decode_pool(model, 16, 8 << 20)
    lp = DecodeLoop(
        SparseDecoder(model, pool, topk_buffer_size=64, max_num_seqs=2, max_model_len=4096), model.config.eos_token_id
    )
    try:
        done = threading.Event()
        n, c = 20, model.config
        lp.expect_remote(
            "long",
            list(range(n)),
            SamplingParams(max_tokens=4000, ignore_eos=True),
            lambda kind, value: done.set() if kind in ("done", "error") else None,
        )
        for layer in range(len(model.cache_layers)):
            lp.write_rows("long", layer, 0, torch.randn(n, c.kv_row_width), torch.randn(n, c.index_head_dim))
        lp.prefill_done("long", n, 7)
        time.sleep(0.2)  # decoding now
        waits = []
        for _ in range(20):
            t = time.monotonic()
            lp.stats()
            waits.append(time.monotonic() - t)
            time.sleep(0.01)
        assert not done.is_set(), ("the generation ended before the measurement", waits)
        t = time.monotonic()
        assert lp.cancel("long", "test")
        waits.append(time.monotonic() - t)
        assert max(waits) < 0.5, waits
    finally:
        lp.close()
        pool.close()


def _install_prompt(lp: DecodeLoop, request_id: str, n: int, first_token: int = 7) -> None:
    c = lp.decoder.model.config
    for layer in range(len(lp.decoder.model.cache_layers)):
        lp.write_rows(request_id, layer, 0, torch.randn(n, c.kv_row_width), torch.randn(n, c.index_head_dim))
    lp.prefill_done(request_id, n, first_token)


class _TokenArrivals:
    """When each request's tokens arrived (``stamps``) and whether it ended (``done``)."""

    def __init__(self, *rids: str) -> None:
        self.stamps: dict[str, list[float]] = {k: [] for k in rids}
        self.done = {k: threading.Event() for k in rids}

    def emit(self, rid: str):
        def on(kind, value):
            if kind == "token":
                self.stamps[rid].append(time.monotonic())
            elif kind in ("done", "error"):
                self.done[rid].set()

        return on

    def tokens_of(self, rid: str, n: int) -> list[float]:
        """The arrival times of the request's first ``n`` tokens (waiting up to 30 s for them)."""
        deadline = time.monotonic() + 30
        while len(self.stamps[rid]) < n and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(self.stamps[rid]) >= n, self.stamps[rid]
        return self.stamps[rid][:n]


def gaps(ts: list[float]) -> list[float]:
    return [y - x for x, y in zip(ts, ts[1:])]


def test_a_step_waits_at_saturation_only_and_a_request_that_can_join_joins_at_once():
    """Gathering a batch: a lone request decodes at once, step after step, and so does one whose
    batch has room for every request still being prefilled; with more of those than room (a
    backlog) each step is held up to step_gather_s, and the moment one's prompt is complete it
    joins without waiting out the rest."""
    gather = 1.0
    model = tiny_model(dtype="float32")
    pool = build.decode_pool(model, 16, 8 << 20)
    lp = DecodeLoop(
        SparseDecoder(model, pool, topk_buffer_size=64, max_num_seqs=2, max_model_len=256),
        model.config.eos_token_id,
        step_gather_s=gather,
    )
    arrivals = _TokenArrivals("alone", "a", "b", "c")
    stamps, done, emit, tokens_of = arrivals.stamps, arrivals.done, arrivals.emit, arrivals.tokens_of
    try:
        lp.expect_remote("alone", list(range(20)), SamplingParams(max_tokens=6, ignore_eos=True), emit("alone"))
        _install_prompt(lp, "alone", 20)
        assert done["alone"].wait(30)
        assert len(stamps["alone"]) == 6 and max(gaps(stamps["alone"])) < 0.5 * gather, stamps["alone"]

        lp.expect_remote("b", list(range(12)), SamplingParams(max_tokens=2, ignore_eos=True), emit("b"))
        lp.expect_remote("a", list(range(20)), SamplingParams(max_tokens=40, ignore_eos=True), emit("a"))
        _install_prompt(lp, "a", 20)
        assert max(gaps(tokens_of("a", 6))) < 0.5 * gather  # "b" fits the batch's room: no hold
        assert lp.stats()["gather_waits"] == 0
        n = len(stamps["a"])
        lp.expect_remote("c", list(range(12)), SamplingParams(max_tokens=2, ignore_eos=True), emit("c"))
        held = tokens_of("a", n + 3)[n:]  # two on their way, room for one: a backlog
        assert min(gaps(held)) > 0.8 * gather, held
        t = time.monotonic()
        _install_prompt(lp, "b", 12)
        assert done["b"].wait(30)
        assert stamps["b"][0] - t < 0.5 * gather, (t, stamps["b"])  # joined at once, not after the wait
        st = lp.stats()
        assert st["gather_waits"] >= 2 and st["gather_wait_s"] > 1.6 * gather, st
        assert lp.cancel("c", "test")
        assert done["a"].wait(30) and len(stamps["a"]) == 40
    finally:
        lp.close()
        pool.close()


def test_step_gather_must_not_be_negative():
    model = tiny_model(dtype="float32")
    pool = build.decode_pool(model, 16, 8 << 20)
    try:
        with pytest.raises(ValueError, match="step_gather_s=-1"):
            DecodeLoop(
                SparseDecoder(model, pool, topk_buffer_size=64, max_num_seqs=1, max_model_len=256),
                model.config.eos_token_id,
                step_gather_s=-1,
            )
    finally:
        pool.close()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_installed_prefix_grows_only_over_rows_really_installed_in_any_order(data):
    """Contributor shares (and retries of them) arrive in any order: the prefix is always the longest
    run of installed rows from 0, as a set of installed rows says."""
    n = data.draw(st.integers(1, 60))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=6)) if n > 1 else []))
    shares = list(zip([0, *cuts], [*cuts, n]))
    arrivals = data.draw(st.permutations(shares + data.draw(st.lists(st.sampled_from(shares), max_size=3))))
    prefix, ahead, rows = 0, [], set()
    for start, end in arrivals:
        prefix = installed_prefix(prefix, ahead, start, end)
        rows |= set(range(start, end))
        want = next(i for i in range(n + 1) if i not in rows)
        assert prefix == want
        assert all(a > prefix for a, _ in ahead)
    assert prefix == n and not ahead


def test_a_share_that_arrives_before_the_one_in_front_of_it_completes_the_prompt(loop):
    """Two contributor ranks' shares of each layer, the second first: the prompt is complete only once
    both are in (a high-water mark would have dropped the early one and never completed)."""
    model = loop.decoder.model
    loop.expect_remote("s", list(range(40)), SamplingParams(max_tokens=1), lambda *e: None)
    width, (idx_dtype, idx_width) = model.config.kv_row_width, model.index_codec.storage(model.dtype)
    for layer in range(len(model.cache_layers)):
        loop.write_rows("s", layer, 25, torch.zeros(15, width), torch.zeros(15, idx_width, dtype=idx_dtype))
    assert "layer 0 has 0 of 40 rows" in loop.check_prompt_complete("s")
    for layer in range(len(model.cache_layers)):
        loop.write_rows("s", layer, 0, torch.zeros(25, width), torch.zeros(25, idx_width, dtype=idx_dtype))
    assert loop.pending["s"].rows == [40] * len(model.cache_layers)
    assert loop.check_prompt_complete("s").endswith("incomplete: no first token")  # the rows are all in
