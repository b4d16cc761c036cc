"""compose.mooncake.yaml's stack across containers (testcontainers, Ryuk off): test_containers.py's
stack with a ``mooncake-master`` container (image kvoffload/mooncake-master, the command of
compose.mooncake.yaml) in place of the metastore, and the prefill's host pool on Mooncake Store
(``"backend": "mooncake"``, no --metastore), on a fresh ``internal`` network.

- the prefill connects to the master in its own container (``mooncake_pool_connected``), and the
  images' HEALTHCHECKs (the master's: its admin /health says service_ready) turn healthy;
- I3: greedy tokens through the proxy equal the single-process engine's;
- a shared long prefix hits the prefix cache on the second request (the prefill's
  ``prefill_finished`` reports it in ``cached_tokens``);
- every container stops in time (2 s; the prefill 2 s plus Mooncake's ~2 s client close).

Needs a Docker engine and the images (``scripts/images``; built here when one is missing), like
test_containers.py, whose stack and helpers (tests/integration/support: ``container_stack``,
``container_requests``) it reuses. Without an engine every test fails, saying why (a missing
dependency is a failure, never a skip). Select with ``-m containers``.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
import yaml
from container_requests import LONG_TEXT, byte_tokenizer, complete
from container_stack import (
    BS,
    PORTS,
    ROOT,
    ContainerStack,
    ensure_images,
    held,
    require_docker_engine,
    running,
    served_reference,
    stop_times,
    wait_idle,
)
from container_stack import (
    COMMANDS as REFERENCE_COMMANDS,
)

from kvoffload_testing.connector_configs import prefill_kv_transfer_config
from poolbackends.mooncake_master import port_answers

pytestmark = [pytest.mark.containers, pytest.mark.slow]


@pytest.fixture(autouse=True, scope="module")
def docker_engine() -> None:
    """Fails every test of this module, with the reason, when no Docker engine answers."""
    require_docker_engine()


MASTER = "mooncake-master"
SERVICES = (MASTER, "prefill", "decode", "proxy")
MASTER_ADDRESS = f"{MASTER}:50051"
MASTER_PORTS = {MASTER: 9003, f"{MASTER}-rpc": 50051}  # admin/metrics (/health), RPC


def _commands() -> dict[str, list[str]]:
    """test_containers.py's commands, with compose.mooncake.yaml's master and the prefill without
    --metastore, its store connector on Mooncake Store."""
    compose = yaml.safe_load((ROOT / "compose.mooncake.yaml").read_text())
    prefill = list(REFERENCE_COMMANDS["prefill"])
    i = prefill.index("--metastore")
    del prefill[i : i + 2]
    prefill[prefill.index("--kv-transfer-config") + 1] = prefill_kv_transfer_config(
        PORTS["decode-control"], mooncake_master=MASTER_ADDRESS
    )
    return {**REFERENCE_COMMANDS, "prefill": prefill, MASTER: compose["services"][MASTER]["command"]}


COMMANDS = _commands()


class MooncakeStack(ContainerStack):
    """mooncake-master, decode, prefill and proxy in containers on one internal network."""

    commands = COMMANDS

    def start(self) -> None:
        self.network.create()
        for name in (MASTER, "decode"):
            self._run(name)
        self.wait_ready(MASTER)  # the prefill connects to it at start-up (5 s, or it exits)
        self._run("prefill")
        for name in ("decode", "prefill"):
            self.wait_ready(name)
        self._run("proxy")
        self.wait_ready("proxy")

    def target(self, port_name: str) -> str:  # the master's health (HTTP /health) and RPC ports too
        if port_name in MASTER_PORTS:
            return f"{self.ip(MASTER)}:{MASTER_PORTS[port_name]}"
        return super().target(port_name)

    def events(self, name: str, event: str) -> list[dict]:
        """The JSON log lines of one container with that ``event``."""
        out = []
        for line in self.wrapped(name).logs().decode(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("event") == event:
                    out.append(record)
        return out


@pytest.fixture(scope="module")
def images():
    """The images of this stack (an older build has no mooncake-master, nor Mooncake Store in its
    prefill: scripts/images builds them)."""
    return ensure_images(SERVICES)


@pytest.fixture(scope="module")
def stack(images, tmp_path_factory):
    yield from running(MooncakeStack(images, tmp_path_factory.mktemp("mooncake-container-logs")))


@pytest.fixture(scope="module")
def reference(stack, tmp_path_factory):
    """The single-process engine, with the decode container's model files."""
    return served_reference(stack, tmp_path_factory)


def _finished(stack: MooncakeStack, request_id: str) -> dict:
    deadline = time.monotonic() + 10  # the line reaches the container's log
    while not (found := [e for e in stack.events("prefill", "prefill_finished") if e.get("request_id") == request_id]):
        assert time.monotonic() < deadline, f"no prefill_finished for {request_id}"
        time.sleep(0.2)
    [event] = found
    return event


# -- tests -------------------------------------------------------------------------------------------


def test_the_prefill_pool_is_on_the_master_container(stack):
    [connected] = stack.events("prefill", "mooncake_pool_connected")
    assert connected["master"] == MASTER_ADDRESS, connected
    assert "--metastore" not in COMMANDS["prefill"]
    assert port_answers(stack.ip(MASTER), MASTER_PORTS[f"{MASTER}-rpc"], 3.0)  # the RPC port the prefill uses
    for name in SERVICES:  # the images' own HEALTHCHECKs agree (a first probe may still be pending)
        deadline = time.monotonic() + 30
        while (status := stack.wrapped(name).attrs["State"].get("Health", {}).get("Status")) != "healthy":
            assert status in ("starting", None) and time.monotonic() < deadline, (name, status)
            time.sleep(1)
    assert held(stack.stats("prefill", "decode")) == {k: 0.0 for k in held(stack.stats("prefill", "decode"))}


def test_i3_through_the_proxy(stack, reference):
    tok = byte_tokenizer()
    prompts = [[65], list(range(66, 66 + BS - 1)), tok.encode(LONG_TEXT[:4200], add_bos=True)]
    for prompt in prompts:
        assert complete(stack.url, prompt, 12, request_id=f"mooncake-i3-{uuid.uuid4().hex}") == reference(prompt, 12), (
            len(prompt)
        )
    assert complete(stack.url, prompts[2], 12, stream=True) == reference(prompts[2], 12)
    decode = dict(stack.stats("decode")["decode"].counters)
    assert decode["reads_streamed"] > 0 and decode["reads_shared_memory"] == 0  # separate hosts
    assert not wait_idle(stack, "prefill", "decode")


def test_a_shared_long_prefix_hits_the_prefix_cache(stack, reference):
    """Two prompts sharing a 1500-token prefix, one after the other: the second reports the whole
    shared prefix (whole blocks) as cached, read from the pool on Mooncake Store; tokens equal the
    reference."""
    tok = byte_tokenizer()
    prefix = "".join(chr(40 + (i * 31) % 80) for i in range(1500))
    cached = []
    for n in range(2):
        ids = tok.encode(prefix + f" question {n}: why?", add_bos=True)
        rid = f"mooncake-prefix-{uuid.uuid4().hex}"
        assert complete(stack.url, ids, 6, request_id=rid) == reference(ids, 6)
        cached.append(_finished(stack, rid)["cached_tokens"])
    assert cached[0] == 0, cached
    assert cached[1] >= (1 + 1500) // BS * BS, cached  # BOS + prefix, whole blocks
    assert not wait_idle(stack, "prefill", "decode")


# A Mooncake store client's close() takes about 2 s (measured on this machine, in Mooncake's own
# code), and the prefill closes its client in its ordered shutdown, after its objects left the store
# (so no other prefill meets them later): that container's bound is 2 s plus that close.
MOONCAKE_CLIENT_CLOSE_S = 2.0
STOP_BOUND_S = {"proxy": 2.0, "prefill": 2.0 + MOONCAKE_CLIENT_CLOSE_S, "decode": 2.0, MASTER: 2.0}


def test_every_container_stops_in_time(stack):
    """Last (it stops the stack): SIGTERM through the init process ends each idle container
    cleanly (exit 0), in compose's order, within 2 s (the prefill: 2 s plus Mooncake's client close),
    well inside compose's 10 s grace. The first stop past its bound fails (``stop_times``)."""
    stop_times(stack, STOP_BOUND_S)
