"""Least-loaded choice and load accounting."""

import pytest

from kvoffload_proxy.balancer import Balancer
from kvoffload_proxy.config import Backend


def _backends(n, role="decoder"):
    return [Backend(role=role, index=i, host="127.0.0.1", port=8000 + i) for i in range(n)]


def test_picks_min_active_tokens():
    bal = Balancer(_backends(3))
    a = bal.acquire(100)
    b = bal.acquire(10)
    c = bal.acquire(50)
    assert [a.index, b.index, c.index] == [0, 1, 2]
    assert bal.peek() == 1  # 10 tokens is least
    assert bal.acquire(5).index == 1
    a.release()
    assert bal.peek() == 0


def test_ties_round_robin_over_idle_backends():
    bal = Balancer(_backends(3))
    picks = []
    for _ in range(6):
        lease = bal.acquire(7)
        picks.append(lease.index)
        lease.release()
    assert picks == [0, 1, 2, 0, 1, 2]


def test_prefill_score_weights_kv():
    bal = Balancer(_backends(2, "prefiller"), kv_weight=0.3)
    a = bal.acquire(100, 100)  # score 130
    b = bal.acquire(120, 0)  # score 120
    assert (a.index, b.index) == (0, 1)
    assert bal.score(0) == pytest.approx(130) and bal.score(1) == pytest.approx(120)
    assert bal.peek() == 1
    a.release_tokens()  # prefill answered; KV still held until the decoders pulled it
    assert bal.score(0) == pytest.approx(30)
    assert bal.peek() == 0
    assert bal.loads[0].num_active_requests == 1
    a.release()
    assert bal.loads[0].num_active_requests == 0 and bal.score(0) == 0


def test_releases_are_idempotent_and_never_negative():
    bal = Balancer(_backends(1), kv_weight=0.3)
    lease = bal.acquire(10, 20)
    lease.release_kv()
    lease.release_kv()
    lease.release()
    lease.release()
    lease.release_tokens()
    assert lease.is_released and bal.is_idle


def test_exclude_prefers_untried_then_falls_back():
    bal = Balancer(_backends(3))
    assert bal.peek(exclude={0}) == 1
    assert bal.peek(exclude={0, 1}) == 2
    assert bal.peek(exclude={0, 1, 2}) in (0, 1, 2)
    # exclusion leaves the heap intact
    assert bal.peek() == 0


def test_peek_has_no_side_effects():
    bal = Balancer(_backends(2))
    for _ in range(5):
        assert bal.peek() == 0
    assert bal.is_idle


def test_heap_stays_bounded_under_churn():
    bal = Balancer(_backends(4))
    for i in range(10_000):
        bal.acquire(i % 97).release()
    assert len(bal._heap) <= 4 * 4 + 64 + 1
    assert bal.is_idle


def test_matches_linear_scan_model():
    import random

    rng = random.Random(0)
    bal = Balancer(_backends(5, "prefiller"), kv_weight=0.3)  # the token score
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            lease = live.pop(rng.randrange(len(live)))
            rng.choice([lease.release, lease.release_tokens, lease.release_kv])()
            if not lease.is_released:
                live.append(lease)
        else:
            best = min(bal.score(i) for i in range(5))
            lease = bal.acquire(rng.randrange(1, 500), rng.randrange(0, 500))
            live.append(lease)
            assert bal.score(lease.index) - lease._tokens - 0.3 * lease._kv_tokens == pytest.approx(best)
    for lease in live:
        lease.release()
    assert bal.is_idle


def test_needs_backends():
    with pytest.raises(ValueError):
        Balancer([])


def test_decoders_go_by_queue_depth_then_free_pool_bytes():
    bal = Balancer(_backends(3))
    assert bal.by_queue
    a = bal.acquire(5000)  # one long request on 0
    b = bal.acquire(10)
    c = bal.acquire(10)
    d = bal.acquire(10)  # every decoder has one: the fewest tokens wins the tie (0 has the most)
    assert [a.index, b.index, c.index] == [0, 1, 2] and d.index in (1, 2)
    other = 3 - d.index
    assert bal.peek() == other  # one in flight on 0 and on `other`; `other` has fewer tokens
    bal.report(other, {"queued": 0, "free_pool_bytes": 10})
    bal.report(0, {"queued": 0, "free_pool_bytes": 1 << 30})
    assert bal.peek() == 0  # same queue depth: more free pool bytes wins over fewer tokens
    for lease in (a, b, c, d):
        lease.release()
    assert bal.is_idle


def test_a_decoder_that_answered_429_counts_full_until_retry_after():
    bal = Balancer(_backends(2))
    bal.mark_full(0, 30)
    assert bal.full() == {0} and bal.loads[0].rejections == 1
    bal.mark_full(1, 0)
    assert bal.full() == {0}
