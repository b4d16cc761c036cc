"""P/D pairs: TP ratio and transfer backend of a prefill and a decode deployment, the TP ranks that
feed each decode rank, their share of the rows, and the layout-exchange handshake."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from settings_support import DECODE_KW, DECODE_SPARSE, LAYOUT, d2h, prefill_multi, store

from kvcore.config.connectors import D2HConnectorConfig
from kvcore.config.decode_settings import DecodeSettings, decode_settings
from kvcore.config.errors import ConfigError
from kvcore.config.prefill_settings import PrefillSettings, prefill_settings
from kvcore.pdpair import check_pd_pair, contributor_share, tp_contributors, tp_handshake_problem, tp_target

# ------------------------------------------------------------------------------------------------
# P/D pairs


def pair(p_kv: Any, d_kv: Any, p_tp: int, d_tp: int) -> tuple[PrefillSettings, DecodeSettings]:
    return (
        prefill_settings(p_kv, None, LAYOUT, tp=p_tp),
        decode_settings(d_kv, DECODE_SPARSE, LAYOUT, **DECODE_KW, tp=d_tp),
    )


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (4, 2), (8, 1), (4, 4)])
def test_pd_pair_ok(p_tp: int, d_tp: int) -> None:
    check_pd_pair(*pair(prefill_multi(), d2h(), p_tp, d_tp))
    check_pd_pair(*pair(prefill_multi("kvoffload", "kvoffload"), d2h("kvoffload"), p_tp, d_tp))


@pytest.mark.parametrize(
    ("p_kv", "d_kv", "p_tp", "d_tp", "words"),
    [
        (prefill_multi(), d2h(), 2, 4, ["tp", "prefill tp 2", "decode tp 4", ">= decode TP and divisible"]),
        (prefill_multi(), d2h(), 6, 4, ["prefill tp 6", "decode tp 4"]),
        (store(), d2h(), 1, 1, ["prefill kv_connector", "SfaRemoteD2HConnector", "both sides"]),
        (
            prefill_multi(transfer_backend="kvoffload"),
            d2h("memfabric"),
            1,
            1,
            ["transfer_backend", "prefill 'kvoffload' != decode 'memfabric'", "same transfer_backend"],
        ),
    ],
)
def test_pd_pair_errors(p_kv: Any, d_kv: Any, p_tp: int, d_tp: int, words: list[str]) -> None:
    prefill, decode = pair(p_kv, d_kv, p_tp, d_tp)
    with pytest.raises(ConfigError) as info:
        check_pd_pair(prefill, decode)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)


def test_pd_pair_missing_transfer_backends() -> None:
    prefill = prefill_settings(prefill_multi(), None, LAYOUT)
    decode = decode_settings(d2h(), DECODE_SPARSE, LAYOUT, **DECODE_KW)
    no_p = dataclasses.replace(prefill, d2h=D2HConnectorConfig())
    no_d = dataclasses.replace(decode, d2h=D2HConnectorConfig())
    with pytest.raises(ConfigError) as info:
        check_pd_pair(no_p, no_d)
    assert [e.split(":")[0] for e in info.value.errors] == [
        "prefill kv_connector_extra_config.transfer_backend",
        "decode kv_connector_extra_config.transfer_backend",
    ]


@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (4, 1), (4, 2), (8, 4), (16, 16)])
def test_tp_contributors_partition_the_prefill_ranks(p_tp, d_tp):
    groups = [tp_contributors(p_tp, d_tp, r) for r in range(d_tp)]
    assert sorted(x for g in groups for x in g) == list(range(p_tp))  # every prefill rank feeds exactly one
    assert all(len(g) == p_tp // d_tp for g in groups)
    for r, g in enumerate(groups):
        assert all(tp_target(p_tp, d_tp, p) == r for p in g)


@pytest.mark.parametrize("p_tp, d_tp, rank", [(2, 4, 0), (6, 4, 0), (4, 2, 2), (0, 1, 0)])
def test_tp_contributors_reject_bad_ratios_and_ranks(p_tp, d_tp, rank):
    with pytest.raises(ValueError):
        tp_contributors(p_tp, d_tp, rank)


@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (2, 1), (2, 2), (4, 2), (8, 4)])
def test_the_handshake_accepts_exactly_the_contributors_of_a_decode_rank(p_tp, d_tp):
    for d in range(d_tp):
        for p in range(p_tp):
            problem = tp_handshake_problem(p_tp, p, d_tp, d)
            assert (problem == "") == (p in tp_contributors(p_tp, d_tp, d)), (p, d, problem)
            if problem:  # both sides' ranks named
                assert f"prefill tp rank {p} of {p_tp}" in problem and f"decode tp rank {d}" in problem


@pytest.mark.parametrize(
    "p_tp, p_rank, d_tp, d_rank, words",
    [
        (1, 0, 2, 0, ["prefill tp 1", "decode tp 2", ">= decode TP"]),
        (6, 0, 4, 0, ["prefill tp 6", "decode tp 4", "divisible"]),
        (0, 0, 1, 0, ["prefill tp 0", "decode tp 1"]),
        (2, 2, 1, 0, ["prefill_tp_rank: 2", "0..1", "prefill tp 2"]),
        (2, 0, 1, 1, ["decode_tp_rank: 1", "0..0", "decode tp 1"]),
        (2, 0, 1, True, ["decode_tp_rank: True (bool)"]),
    ],
)
def test_the_handshake_names_both_values_of_a_mismatch(p_tp, p_rank, d_tp, d_rank, words):
    problem = tp_handshake_problem(p_tp, p_rank, d_tp, d_rank)
    for word in words:
        assert word in problem, (word, problem)


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 500), n=st.integers(0, 300), count=st.integers(1, 8))
def test_contributor_shares_partition_the_rows(start, n, count):
    shares = [contributor_share(start, start + n, i, count) for i in range(count)]
    assert shares[0][0] == start and shares[-1][1] == start + n
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    assert max(b - a for a, b in shares) - min(b - a for a, b in shares) <= 1


def test_a_contributor_outside_its_group_has_no_share():
    with pytest.raises(ValueError, match="contributor 2 outside 0..1"):
        contributor_share(0, 10, 2, 2)
