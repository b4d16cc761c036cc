"""Shared fixtures: a fresh proxy's /metrics text."""

import pytest


@pytest.fixture
def proxy_text() -> str:
    """A fresh proxy's /metrics (one decoder, one prefiller, nothing served yet)."""
    from kvoffload_proxy.balancer import Balancer
    from kvoffload_proxy.config import Backend
    from kvoffload_proxy.metrics import ProxyMetrics

    decoders = Balancer([Backend(role="decoder", index=0, host="127.0.0.1", port=8200)])
    prefillers = Balancer([Backend(role="prefiller", index=0, host="127.0.0.1", port=8100)])
    return ProxyMetrics([prefillers, decoders], lambda: 0).render().decode()
