"""``container_stack.stop_times`` on a fake stack (no Docker engine, no containers): each container is
stopped in order within its bound, and the first stop past its bound fails at once, naming it and the
times so far, instead of restarting the container and keeping the better of two measurements."""

from __future__ import annotations

from types import SimpleNamespace

import container_stack
import pytest


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class _Container:
    def __init__(self, name: str, stack: _Stack) -> None:
        self.name, self.stack = name, stack
        self.attrs = {"State": {"ExitCode": stack.exit_codes.get(name, 0)}}

    def stop(self, timeout: int) -> None:
        self.stack.stopped.append(self.name)
        self.stack.clock.now += self.stack.stop_s[self.name]

    def reload(self) -> None:
        pass

    def logs(self) -> bytes:
        return b"its last words"


class _Stack:
    def __init__(self, stop_s: dict[str, float], exit_codes: dict[str, int] | None = None) -> None:
        self.stop_s, self.exit_codes = stop_s, exit_codes or {}
        self.clock, self.stopped, self.restarted = _Clock(), [], []

    def wrapped(self, name: str) -> _Container:
        return _Container(name, self)

    def restart(self, name: str) -> None:
        self.restarted.append(name)


@pytest.fixture
def fake_time(monkeypatch):
    def use(stack: _Stack) -> None:
        monkeypatch.setattr(container_stack, "time", SimpleNamespace(monotonic=stack.clock.monotonic))

    return use


def test_the_first_slow_stop_fails_without_being_measured_again(fake_time):
    stack = _Stack({"proxy": 0.4, "prefill": 2.5, "decode": 0.3, "metastore": 0.2})
    fake_time(stack)
    with pytest.raises(AssertionError, match=r"prefill took 2\.50 s to stop, its bound is 2\.0 s.*'proxy': 0\.4"):
        container_stack.stop_times(stack, dict.fromkeys(("proxy", "prefill", "decode", "metastore"), 2.0))
    assert stack.stopped == ["proxy", "prefill"] and stack.restarted == []  # no second try, nothing after it


def test_every_container_within_its_bound_is_stopped_in_order(fake_time):
    stack = _Stack({"mooncake-master": 0.5, "prefill": 3.5, "decode": 0.3})
    fake_time(stack)
    took = container_stack.stop_times(stack, {"prefill": 4.0, "decode": 2.0, "mooncake-master": 2.0})
    assert took == pytest.approx({"prefill": 3.5, "decode": 0.3, "mooncake-master": 0.5})
    assert list(took) == ["prefill", "decode", "mooncake-master"]
    assert stack.stopped == ["prefill", "decode", "mooncake-master"] and stack.restarted == []


def test_a_stop_that_did_not_exit_0_fails(fake_time):
    stack = _Stack({"proxy": 0.1}, exit_codes={"proxy": 137})
    fake_time(stack)
    with pytest.raises(AssertionError, match="proxy"):
        container_stack.stop_times(stack, {"proxy": 2.0})
