"""The images across containers (testcontainers, Ryuk off): metastore, prefill, decode and proxy,
each in its own container on a fresh ``internal`` Docker network (no route out; the host reaches
the containers at their addresses on it), with the images' default configs (MultiConnector prefill,
sparse-offload decode).

- Every service answers its gRPC Health and Stats (the proxy, which has no gRPC, its /healthcheck);
- I3 across hosts: greedy tokens through the proxy equal the single-process engine's, and the decode
  pulled every layer over gRPC streaming (LayerSource), never through shared memory;
- faults: the decode container stopped during a pull, the prefill container stopped during a
  prefill. The client gets, within a bounded time, the error the fault suite's catalogue gives a
  killed decode or prefill (``fault_catalog.wrong_error``: its status, and a message naming the
  stopped service as the proxy and the services name it), the surviving services return to
  idle (no held slot, pool byte, lease or open request in their Stats), and once the stopped
  container is started again a new request succeeds with the right tokens.

Needs a Docker engine (``scripts/dockerd start``) and the images (``scripts/images``; built here when
missing); ``make test`` starts both. Without an engine every test fails, saying why (a missing
dependency is a failure, never a skip). Select with ``-m containers``, leave out with
``-m "not containers"``.
"""

from __future__ import annotations

import threading
import time
import urllib.error

import pytest
from container_requests import ERROR_DEADLINE_S, LONG_TEXT, byte_tokenizer, complete
from container_stack import (
    BS,
    IDLE_DEADLINE_S,
    PORTS,
    SERVICES,
    ContainerStack,
    ensure_images,
    grpc_health,
    grpc_stats,
    healthy,
    held,
    require_docker_engine,
    running,
    served_reference,
    stop_times,
    wait_idle,
)

from kvoffload_testing.fault_catalog import named_peers, request, wrong_error

pytestmark = [pytest.mark.containers, pytest.mark.slow]


@pytest.fixture(autouse=True, scope="module")
def docker_engine() -> None:
    """Fails every test of this module, with the reason, when no Docker engine answers."""
    require_docker_engine()


@pytest.fixture(scope="module")
def images():
    """The four images of this stack."""
    return ensure_images(SERVICES)


@pytest.fixture(scope="module")
def stack(images, tmp_path_factory):
    yield from running(ContainerStack(images, tmp_path_factory.mktemp("container-logs")))


@pytest.fixture(scope="module")
def reference(stack, tmp_path_factory):
    """Greedy tokens of the single-process engine, with the served model's own files."""
    return served_reference(stack, tmp_path_factory)


# how the proxy and the services name the prefill and the decode in errors: the proxy by its
# --prefiller-hosts / --decoder-hosts URL, the services by the host they advertise (the container's
# hostname, docker/entrypoint) and their gRPC port
NAMES = named_peers(
    ("prefill", PORTS["prefill"], PORTS["prefill-data"]), ("decode", PORTS["decode"], PORTS["decode-control"])
)


class _Request:
    """One streamed request in a thread, sent by the fault suite's client (``fault_catalog.request``:
    its error written the way ``wrong_error`` reads it): its outcome and when it ended."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int) -> None:
        self.ok, self.tokens, self.error = False, [], ""
        self.ended_at: float | None = None
        self._th = threading.Thread(target=self._run, args=(url, prompt, max_tokens), daemon=True)
        self._th.start()

    def _run(self, url: str, prompt: list[int], max_tokens: int) -> None:
        try:
            self.ok, self.tokens, self.error = request(url, prompt, True, ERROR_DEADLINE_S + 30, max_tokens)
        finally:
            self.ended_at = time.monotonic()

    def join(self, timeout_s: float) -> None:
        self._th.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._th.is_alive()


# -- tests -------------------------------------------------------------------------------------------


def test_every_service_answers_health_and_stats(stack):
    for name, where in (("metastore", "metastore"), ("prefill", "prefill-data"), ("decode", "decode-control")):
        assert grpc_health(stack.target(where)) == "SERVING", name
        reply = grpc_stats(stack.target(where))
        assert reply.service == f"kvoffload-{name}" and reply.version, reply
        assert len(reply.counters) > 3, (name, dict(reply.counters))
    assert healthy(stack, "proxy") and healthy(stack, "prefill") and healthy(stack, "decode")
    for name in SERVICES:  # the image's own HEALTHCHECK agrees (its first probe may still be pending)
        deadline = time.monotonic() + 30
        while (status := stack.wrapped(name).attrs["State"].get("Health", {}).get("Status")) != "healthy":
            assert status in ("starting", None) and time.monotonic() < deadline, (name, status)
            time.sleep(1)
    assert held(stack.stats()) == {k: 0.0 for k in held(stack.stats())}


def test_i3_across_containers_streams_layers_over_grpc(stack, reference):
    tok = byte_tokenizer()
    before = dict(stack.stats("decode")["decode"].counters)
    prompts = [[65], list(range(66, 66 + BS - 1)), tok.encode(LONG_TEXT[:4200], add_bos=True)]
    for prompt in prompts:
        assert complete(stack.url, prompt, 12) == reference(prompt, 12), len(prompt)
    assert complete(stack.url, prompts[1], 12, stream=True) == reference(prompts[1], 12)
    after = dict(stack.stats("decode")["decode"].counters)
    assert after["reads_streamed"] > before["reads_streamed"]
    assert after["reads_shared_memory"] == before["reads_shared_memory"] == 0  # separate hosts: no shm
    assert after["read_failed"] == before["read_failed"]
    assert not wait_idle(stack)


def _fault(stack: ContainerStack, reference, victim: str, trigger: tuple[str, str], survivors: tuple[str, ...]) -> None:
    """Send a long request, stop ``victim`` once ``trigger`` (service, counter) moved, then judge: the
    error must be the one the fault catalogue gives a killed ``victim`` (``kill_<victim>``)."""
    tok = byte_tokenizer()
    prompt = tok.encode(LONG_TEXT, add_bos=True)  # 7901 tokens: 4 chunks x 5 layers, seconds of prefill
    service, counter = trigger
    base = dict(stack.stats(service)[service].counters).get(counter, 0.0)
    req = _Request(stack.url, prompt, 8)
    deadline = time.monotonic() + 120
    while dict(stack.stats(service)[service].counters).get(counter, 0.0) <= base:
        assert req.running, f"the request ended before the fault could be injected: {req.tokens or req.error}"
        assert time.monotonic() < deadline, f"{service}.{counter} never moved"
        time.sleep(0.01)
    stopped_at = time.monotonic()
    stack.wrapped(victim).stop(timeout=0)  # no grace: SIGTERM then SIGKILL at once, as a lost host
    stack.save_logs(victim)
    req.join(ERROR_DEADLINE_S)
    assert not req.running, f"the client still waits {ERROR_DEADLINE_S:.0f}s after {victim} stopped"
    assert not req.ok, f"the request succeeded although {victim} stopped mid-way: {req.tokens}"
    assert req.ended_at is not None
    took = req.ended_at - stopped_at
    print(f"{victim} stopped: the client got, after {took:.1f}s: {req.error}")
    why = wrong_error(f"kill_{victim}", req.error, NAMES)
    assert why == "", f"{why}; the error: {req.error}"
    assert took <= ERROR_DEADLINE_S
    leaks = wait_idle(stack, *survivors)
    assert not leaks, f"after {victim} stopped, the survivors still hold {leaks}"
    print(f"{', '.join(survivors)} idle {time.monotonic() - req.ended_at:.1f}s after the error")
    stack.restart(victim)
    fresh = tok.encode("after the restart: " + LONG_TEXT[:1500], add_bos=True)
    deadline = time.monotonic() + 60
    while True:  # the proxy's health probes need a moment to see the restarted backend
        try:
            got = complete(stack.url, fresh, 8, timeout_s=120)
            break
        except urllib.error.HTTPError as exc:
            assert time.monotonic() < deadline, f"no request succeeds after {victim} restarted: {exc.read()[:500]}"
            time.sleep(1)
    assert got == reference(fresh, 8)
    assert not wait_idle(stack)


def test_decode_stopped_during_a_pull(stack, reference):
    _fault(stack, reference, "decode", trigger=("decode", "read_done"), survivors=("metastore", "prefill"))


def test_prefill_stopped_during_a_prefill(stack, reference):
    _fault(stack, reference, "prefill", trigger=("prefill", "acquires"), survivors=("metastore", "decode"))
    deadline = time.monotonic() + IDLE_DEADLINE_S  # the lost prefill's pool leaves the metastore's registry
    while (pools := dict(stack.stats("metastore")["metastore"].counters)["pools"]) != 1:
        assert time.monotonic() < deadline, f"the metastore still lists {pools:.0f} pools after the prefill restarted"
        time.sleep(0.5)


def test_every_container_stops_within_2s(stack):
    """Last (it stops the stack): SIGTERM through the init process ends each idle service cleanly
    (exit 0) in under 2 s, proxy first, as compose stops them; the first slower stop fails."""
    stop_times(stack, dict.fromkeys(("proxy", "prefill", "decode", "metastore"), 2.0))
