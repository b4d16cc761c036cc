"""``free_stack_ports``: every port a stack will bind is checked free, a TP decode's whole range of
control ports included."""

from __future__ import annotations

import pytest

from kvoffload_testing import ports
from kvoffload_testing.stack import StackConfig


def checked_ports(monkeypatch, **kw) -> tuple[dict, set[int]]:
    """What ``free_stack_ports(**kw)`` returns, and every port it checked for its answer's base."""
    seen: list[int] = []
    monkeypatch.setattr(ports, "port_is_free", lambda port, host="127.0.0.1": seen.append(port) or True)
    out = ports.free_stack_ports(**kw)
    return out, set(seen)


@pytest.mark.parametrize("decode_dp", [False, True])
def test_every_control_port_of_a_tp_decode_is_checked(monkeypatch, tmp_path, decode_dp):
    out, seen = checked_ports(monkeypatch, prefills=1, decodes=2, decode_tp=2)
    cfg = StackConfig(model=tmp_path, log_dir=tmp_path, decode_tp=2, decode_dp=decode_dp, **out)
    for i in range(2):
        for t in range(2):
            assert cfg.decode_control_port(i) + t in seen, (i, t)
    assert {out["proxy_port"], out["metastore_port"], *out["prefill_ports"], *out["decode_ports"]} <= seen


def test_a_tp_that_does_not_fit_the_control_ports_is_refused():
    with pytest.raises(ValueError, match="decode_tp: got 9"):
        ports.free_stack_ports(decodes=2, decode_tp=9)
