"""How errors name the prefill and the decode of a stack that is not on loopback
(``fault_catalog.named_peers``; the container tests judge their faults' errors with it and
``wrong_error``): the proxy's backend URLs and the services' advertised host and gRPC port, here the
container hostnames of tests/integration/test_containers.py. No processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload_testing.fault_catalog import named_peers, peer_names, wrong_error

CONTAINERS = named_peers(("prefill", 8100, 18100), ("decode", 8200, 20050))

# errors as the suite's client (``fault_catalog.request``) writes them, phrased as the proxy and the
# services phrase them in the container stack
DECODE_DIED = (
    "SSE error 502: decoder http://decode:8200 failed while relaying the response: "
    "ClientPayloadError: Response payload is not completed"
)
DECODE_GONE = (
    'HTTP 502: {"error": {"message": "prefiller http://prefill:8100 answered HTTP 502: prefill failed: '
    'request cmpl-2 stopped before layer 3: decode decode:20050 no longer waits for request cmpl-2"}}'
)
PREFILL_DIED = "SSE error 502: prefiller http://prefill:8100 failed while running the prefill: ServerDisconnectedError"
PREFILL_QUIET = (
    "SSE error 502: decoder http://decode:8200 reported an error: prefill prefill:18100 sent no news for "
    "request cmpl-3 for 10.0 s at stage computing"
)


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ("kill_decode", DECODE_DIED),
        ("kill_decode", DECODE_GONE),
        ("kill_prefill", PREFILL_DIED),
        ("kill_prefill", PREFILL_QUIET),
    ],
)
def test_a_container_stack_names_the_service_a_fault_hit(fault, error):
    assert wrong_error(fault, error, CONTAINERS) == ""


@pytest.mark.parametrize(
    ("fault", "error", "why"),
    [
        ("kill_prefill", DECODE_DIED, "does not name the prefill"),
        ("kill_decode", PREFILL_DIED, "does not name the decode"),
        # the loopback stack's names are not the containers'
        ("kill_decode", DECODE_DIED.replace("decode:8200", "127.0.0.1:8200"), "does not name the decode"),
        # an SSE error as another client writes it carries no status the catalogue can read
        (
            "kill_decode",
            "RuntimeError: SSE error event: {'message': 'decoder http://decode:8200 failed'}",
            "not no HTTP",
        ),
    ],
)
def test_a_container_stack_error_that_names_another_service_is_wrong(fault, error, why):
    assert why in wrong_error(fault, error, CONTAINERS)


def test_a_loopback_stack_is_named_by_its_host_and_ports():
    from kvoffload_testing.stack import StackConfig

    cfg = StackConfig(model=Path("m"), log_dir=Path("l"), prefill_ports=(8100,), decode_ports=(8200,), kv_port=20050)
    names = peer_names(cfg)
    assert names == named_peers(("127.0.0.1", 8100, 18100), ("127.0.0.1", 8200, cfg.decode_control_port(0)))
    assert names["decode"][:2] == ("http://127.0.0.1:8200", f"decode 127.0.0.1:{cfg.decode_control_port(0)}")
    assert names["prefill"][:2] == ("http://127.0.0.1:8100", "prefill 127.0.0.1:18100")
