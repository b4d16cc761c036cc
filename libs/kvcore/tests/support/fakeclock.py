"""A monotonic clock a test moves by hand (seconds), for code that takes an injectable clock
(the MetaStore's leases and heartbeats)."""

import pytest


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance_ms(self, ms: float) -> None:
        self.now += ms / 1000


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
