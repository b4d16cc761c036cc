"""The registration rendezvous: one dispatch per request, after every child registered; every
registration answered with that outcome; every wait bounded."""

import asyncio

import pytest

from kvoffload_proxy.errors import ProxyError
from kvoffload_proxy.metaserver import Registry
from openai_api.transfer_params import KVTransferParams

P = KVTransferParams.model_validate  # a decoder's registered params


class Dispatcher:
    def __init__(self, fail=None, hang=False):
        self.calls = []
        self.release = asyncio.Event()
        self.fail, self.hang = fail, hang
        self.cancelled = False

    async def __call__(self, rdv):
        self.calls.append(rdv.ordered_params())
        try:
            if self.hang:
                await asyncio.sleep(3600)
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if self.fail:
            raise self.fail


def _registry(dispatch, reg_s=1.0, disp_s=1.0):
    return Registry(dispatch, registration_timeout_s=reg_s, dispatch_timeout_s=disp_s)


async def test_answers_only_after_dispatch_completed():
    d = Dispatcher()
    reg = _registry(d)
    rdv = reg.open("cmpl-1", ("cmpl-1",))
    call = asyncio.create_task(reg.register("cmpl-1", P({"host": "h", "port": 1})))
    await asyncio.sleep(0.05)
    assert d.calls == [[P({"host": "h", "port": 1})]]
    assert not call.done(), "must wait for the prefill dispatch"
    d.release.set()
    await asyncio.wait_for(call, 1)
    assert rdv.outcome.result() is None
    reg.close(rdv)
    assert len(reg) == 0


async def test_batch_dispatches_once_with_params_in_child_order():
    d = Dispatcher()
    reg = _registry(d)
    ids = ("p-0", "p-1", "p-2")
    reg.open("p", ids)
    calls = []
    for cid in ("p-2", "p-0"):
        calls.append(asyncio.create_task(reg.register(cid, P({"id": cid}))))
    await asyncio.sleep(0.05)
    assert d.calls == [], "waits for every child"
    calls.append(asyncio.create_task(reg.register("p-1", P({"id": "p-1"}))))
    await asyncio.sleep(0.05)
    assert d.calls == [[P({"id": "p-0"}), P({"id": "p-1"}), P({"id": "p-2"})]]
    d.release.set()
    await asyncio.wait_for(asyncio.gather(*calls), 1)
    assert len(d.calls) == 1


async def test_dispatch_failure_answers_every_registration_with_it():
    err = ProxyError(502, "prefiller http://p answered HTTP 500", backend="http://p", role="prefiller")
    d = Dispatcher(fail=err)
    d.release.set()
    reg = _registry(d)
    rdv = reg.open("p", ("p-0", "p-1"))
    results = await asyncio.gather(reg.register("p-0", P({})), reg.register("p-1", P({})), return_exceptions=True)
    assert results == [err, err]
    assert rdv.outcome.exception() is err


async def test_missing_registration_times_out_naming_the_child():
    reg = _registry(Dispatcher(), reg_s=0.2)
    rdv = reg.open("p", ("p-0", "p-1"))
    with pytest.raises(ProxyError) as e:
        await asyncio.wait_for(reg.register("p-0", P({})), 2)
    assert e.value.status == 504 and "p-1" in e.value.message and "p-0" not in e.value.message
    reg.close(rdv)


async def test_close_cancels_dispatch_and_answers_waiters():
    d = Dispatcher(hang=True)
    reg = _registry(d)
    rdv = reg.open("p", ("p",))
    call = asyncio.create_task(reg.register("p", P({})))
    await asyncio.sleep(0.05)
    reg.close(rdv)
    with pytest.raises(ProxyError) as e:
        await asyncio.wait_for(call, 1)
    assert e.value.status == 410
    await asyncio.sleep(0)
    assert d.cancelled
    reg.close(rdv)  # idempotent
    with pytest.raises(ProxyError) as e:
        await reg.register("p", P({}))
    assert e.value.status == 404


async def test_dispatch_timeout_is_504():
    reg = _registry(Dispatcher(hang=True), disp_s=0.1)
    reg.open("p", ("p",))
    with pytest.raises(ProxyError) as e:
        await asyncio.wait_for(reg.register("p", P({})), 2)
    assert e.value.status == 504 and "did not complete" in e.value.message


async def test_unknown_id_is_404():
    reg = _registry(Dispatcher())
    with pytest.raises(ProxyError) as e:
        await reg.register("nope", P({}))
    assert e.value.status == 404 and e.value.param == "request_id"


async def test_retry_with_same_params_joins_other_params_conflict():
    d = Dispatcher()
    reg = _registry(d)
    reg.open("p", ("p",))
    first = asyncio.create_task(reg.register("p", P({"a": 1})))
    await asyncio.sleep(0.02)
    again = asyncio.create_task(reg.register("p", P({"a": 1})))
    with pytest.raises(ProxyError) as e:
        await reg.register("p", P({"a": 2}))
    assert e.value.status == 409
    d.release.set()
    await asyncio.wait_for(asyncio.gather(first, again), 1)
    assert len(d.calls) == 1


async def test_registration_survives_caller_cancellation():
    d = Dispatcher()
    d.release.set()
    reg = _registry(d)
    reg.open("p", ("p-0", "p-1"))
    first = asyncio.create_task(reg.register("p-0", P({"x": 0})))
    await asyncio.sleep(0.02)
    first.cancel()  # the decoder dropped its call
    await reg.register("p-1", P({"x": 1}))
    assert d.calls == [[P({"x": 0}), P({"x": 1})]]


async def test_open_refuses_ids_in_use():
    reg = _registry(Dispatcher())
    rdv = reg.open("p", ("p",))
    with pytest.raises(ValueError):
        reg.open("p", ("p",))
    with pytest.raises(ValueError):
        reg.open("q", ("q", "q"))
    reg.close(rdv)
    reg.close(reg.open("p", ("p",)))
    assert len(reg) == 0
