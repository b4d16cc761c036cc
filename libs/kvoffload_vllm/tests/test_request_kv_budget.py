"""The host copies' budget (``layerwise_request_kv_gb``): a reserve past it allocates nothing and
raises naming the key, a drop gives its room back; the start-up check's arithmetic on vLLM's KV cache
spec (one request of max_model_len must fit, max_num_seqs of them not fitting is a warning); the
scheduler's admission makes a request wait, in order, until its worst case fits; config errors
name the key."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from structlog.testing import capture_logs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

from kvcore.config.errors import ConfigError
from kvcore.config.parse import parse_kv_transfer_config
from kvoffload_vllm import request_kv_budget
from kvoffload_vllm.kv_groups import KVGroup, kv_groups
from kvoffload_vllm.layout import CacheLayout
from kvoffload_vllm.request_kv import RequestKV, RequestKVFull
from kvoffload_vllm.request_kv_budget import (
    GIB,
    HostCopies,
    HostCopyAdmission,
    admission_of,
    available_bytes,
    budget_size,
    row_bytes,
)
from kvoffload_vllm.shared_buffers import group_plan, plan_of, requested_in
from kvoffload_vllm.shared_steps import SharedSteps, StepBlocks
from kvoffload_vllm.stats import Counters
from kvoffload_vllm.store import StoreStepMetadata

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)  # 2,048 bytes a block
KEY = "kv_connector_extra_config.layerwise_request_kv_gb"


def transfer_config(**extra) -> dict:
    store = {"backend": "kvoffload", "use_layerwise": True, "metastore": "h:1", "layerwise_num_shared_buffers": 2}
    return {
        "kv_connector": "AscendStoreConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": store | extra,
    }


def vllm_config(max_model_len: int = 1000, max_num_seqs: int = 4, tp: int = 1) -> SimpleNamespace:
    """The fields of a VllmConfig the start-up check reads."""
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
    )


def size_of(gib: float | None, **config):
    """The budget of 6 layers on 3 buffers (layer 0 independent: 5 shared layers) for ``gib``."""
    kv = transfer_config() if gib is None else transfer_config(layerwise_request_kv_gb=gib)
    store = parse_kv_transfer_config(kv, strict=True).store
    groups = kv_groups([KVCacheGroupSpec(LAYERS, SPEC)], "AscendStoreConnector")
    shared = group_plan(requested_in(kv), groups)
    assert shared is not None and store is not None
    return budget_size(vllm_config(**config), store, shared, groups[0]), (store, shared, groups)


def request(rid: str, prompt: int, max_tokens: int | None = 100) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt, max_tokens=max_tokens, prompt_token_ids=[1])


def test_a_reserve_past_the_budget_allocates_nothing_and_names_the_key():
    kv = RequestKV(["x", "y"], 4, budget_bytes=80)  # a block position is 8 bytes: 10 of them
    kv.reserve("a", 6)
    kv.put("a", "y", range(0, 1), torch.full((1, 4), 7, dtype=torch.uint8))
    assert kv.nbytes() == 48
    with pytest.raises(RequestKVFull, match=r"layerwise_request_kv_gb.*nothing was allocated"):
        kv.reserve("b", 5)
    assert "b" not in kv and kv.nbytes() == 48
    kv.reserve("a", 9)  # doubling to 12 would pass the budget: exactly 9
    assert kv.nbytes() == 72 and kv.get("a", "y", range(0, 1)).tolist() == [[7] * 4]
    kv.drop(["a"])  # its room is free again
    assert kv.nbytes() == 0
    kv.reserve("b", 5)
    assert kv.nbytes() == 40


def test_a_copy_grows_by_doubling_but_never_past_its_ceiling():
    kv = RequestKV(["x"], 4)
    kv.reserve("r", 3, ceiling=5)
    kv.reserve("r", 4, ceiling=5)  # doubling 3 -> 6 stops at the ceiling
    assert kv.nbytes() == 5 * 4
    kv.reserve("r", 5, ceiling=5)  # already there: nothing allocated
    assert kv.nbytes() == 5 * 4


def test_the_start_up_check_counts_blocks_shared_layers_block_bytes_and_ranks():
    size, _ = size_of(1.0, max_model_len=1000, max_num_seqs=4, tp=2)
    assert (size.shared_layers, size.row_bytes, size.ranks) == (5, SPEC.page_size_bytes, 2)
    assert size.blocks(1000) == 63 and size.blocks(10**6) == 63  # ceil(1000 / 16), never past max_model_len
    assert size.per_request_bytes == 63 * 5 * 2048 * 2
    assert size.worst_case_bytes == 4 * size.per_request_bytes
    assert size.budget_bytes == GIB and size.source == KEY
    with capture_logs() as logs:
        size.check()  # 1 GiB holds the worst case: no warning
    assert [e["event"] for e in logs] == ["kvoffload_request_kv_budget"]


def test_a_dsa_layers_row_holds_its_indexer_cache_beside_its_latent_one():
    """A host-copy row is a layer's caches side by side (``SharedSteps``), the widest layer's."""
    names = ("model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer.k_cache")
    names += ("model.layers.1.self_attn.attn", "model.layers.1.self_attn.indexer.k_cache")
    pages = [SimpleNamespace(page_size_bytes=b) for b in (41984, 8448, 41984, 8448)]
    assert row_bytes(KVGroup(0, names, 64, tuple(pages)), 2) == 41984 + 8448


def test_a_budget_below_one_request_of_max_model_len_is_refused_naming_the_key_and_the_fix():
    size, _ = size_of(0.001, max_model_len=8192)  # 512 blocks × 5 × 2,048 = 5.0 MiB
    with pytest.raises(ConfigError, match=r"layerwise_request_kv_gb: .*max_model_len 8192 needs .*set "):
        size.check()
    with pytest.raises(ConfigError, match=r"512 blocks × 5 shared layers × 2048 bytes × 1 rank\(s\).*0\.005"):
        size.check()


def test_a_budget_below_max_num_seqs_requests_is_a_warning_naming_the_key():
    size, _ = size_of(0.012, max_model_len=8192, max_num_seqs=8)  # 12.3 MiB: 2 requests of 5 MiB
    with capture_logs() as logs:
        size.check()
    warning = next(e for e in logs if e["log_level"] == "warning")
    assert warning["event"] == "kvoffload_request_kv_budget_short" and warning["key"] == KEY
    assert (warning["requests_of_max_model_len"], warning["max_num_seqs"]) == (2, 8)


def test_the_default_is_a_quarter_of_the_memory_available(monkeypatch):
    monkeypatch.setattr(request_kv_budget, "available_bytes", lambda: 8 * GIB)
    size, _ = size_of(None)
    assert size.budget_bytes == 2 * GIB and "25% of the 8 GiB available" in size.source


def test_the_memory_available_is_memavailable_or_the_cgroups_room(tmp_path):
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:  16000000 kB\nMemAvailable:  8000000 kB\n")
    (proc / "self" / "cgroup").write_text("0::/box\n")
    assert available_bytes(proc, cgroup) == 8000000 * 1024  # no cgroup files: MemAvailable
    (cgroup / "box").mkdir(parents=True)
    (cgroup / "box" / "memory.max").write_text("max\n")
    assert available_bytes(proc, cgroup) == 8000000 * 1024
    (cgroup / "box" / "memory.max").write_text(f"{3 * GIB}\n")
    (cgroup / "box" / "memory.current").write_text(f"{GIB}\n")
    assert available_bytes(proc, cgroup) == 2 * GIB


def test_a_request_waits_in_order_until_its_worst_case_fits_and_a_finish_frees_its_room():
    size, _ = size_of(3 * 63 * 5 * 2048 / GIB, max_model_len=1000)
    admission = HostCopyAdmission(size)  # room for 3 requests of max_model_len
    a, b = request("a", 900, 100), request("b", 500, 1000)  # 63 blocks each (b capped by max_model_len)
    c, d = request("c", 1000, None), request("d", 10, 6)  # c: max_model_len; d: 1 block
    for r in (a, b):
        assert admission.admit(r)
        admission.hold(r)
    admission.hold(request("p", 2000, 0))  # over max_model_len: 63 blocks
    with capture_logs() as logs:
        assert not admission.admit(c) and not admission.admit(c)
        assert not admission.admit(d)  # it would fit, but c waits before it
    assert [(e["event"], e["request_id"], e["key"]) for e in logs] == [
        ("kvoffload_request_kv_wait", "c", KEY),  # once per request
        ("kvoffload_request_kv_wait", "d", KEY),
    ]
    assert admission.max_blocks("a") == 63 and admission.held_bytes() == 3 * 63 * size.block_bytes
    admission.release("a")
    assert admission.take_step() == HostCopies(size.budget_bytes, ("a",))
    assert admission.take_step().finished == ()
    assert not admission.admit(d) and admission.admit(c)  # c first
    admission.hold(c)
    admission.release("b")
    assert admission.admit(d)
    admission.release("d")  # finished while waiting (an abort): holds nothing, nothing to drop
    assert admission.take_step().finished == ("b",)


def test_each_rank_gets_its_share_and_no_shared_buffers_means_no_admission():
    size, (store, shared, groups) = size_of(1.0, tp=4)
    assert HostCopyAdmission(size).take_step().budget_bytes == GIB // 4
    assert admission_of(vllm_config(), store, None, groups) is None
    with capture_logs():
        assert admission_of(vllm_config(), store, shared, groups) is not None


def test_a_step_drops_finished_copies_before_it_reserves_and_fails_a_request_past_the_budget():
    """The worker: the copies of requests vLLM finished go first (the scheduler gave their room to
    this step); a request the budget cannot hold (an admission bug) fails its loads, never the host."""
    names = tuple(LAYERS[:3])
    layout = CacheLayout(names, 8, 4, (4, 8), torch.float32)  # 128-byte blocks
    shared = plan_of(requested_in(transfer_config(layerwise_num_shared_buffers=1)), names, 4, 128, torch.float32)
    assert shared is not None and shared.plan.slots == ((0,), (1, 2))
    slot0, slot1 = torch.zeros(8, 4, 8), torch.zeros(8, 4, 8)
    caches = {names[0]: slot0, names[1]: slot1, names[2]: slot1}  # 2 shared layers: 256 bytes a block
    errors: list[list[int]] = []
    holder: dict = {}
    steps = SharedSteps(
        shared, layout, caches, ThreadPoolExecutor(1), errors.append, lambda: holder["meta"], Counters([])
    )
    holder["meta"] = StoreStepMetadata(steps=[StepBlocks("a", (1, 2), 0, 8, 2)], host_copies=HostCopies(4 * 256))
    steps.before_attention(names[1], None)
    assert steps.request_kv.nbytes() == 2 * 256
    big = StepBlocks("b", (3, 4, 5, 6), 0, 16, 4)
    holder["meta"] = StoreStepMetadata(steps=[big], host_copies=HostCopies(4 * 256, ("a",)))
    steps.before_attention(names[1], None)
    assert "a" not in steps.request_kv and steps.request_kv.nbytes() == 4 * 256 and errors == []
    holder["meta"] = StoreStepMetadata(steps=[StepBlocks("c", (7,), 0, 4, 1)], host_copies=HostCopies(4 * 256))
    with capture_logs() as logs:
        steps.before_attention(names[1], None)
    assert "c" not in steps.request_kv and errors == [[7]]
    assert "layerwise_request_kv_gb" in next(e for e in logs if e["event"] == "kvoffload_shared_load_failed")["error"]


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (0, "layerwise_request_kv_gb: got 0 (int); must be a number of GiB > 0"),
        ("2GB", "layerwise_request_kv_gb: got '2GB' (str); must be a number of GiB > 0"),
    ],
)
def test_a_bad_budget_is_refused_naming_the_key(value, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_kv_transfer_config(transfer_config(layerwise_request_kv_gb=value), strict=True)


def test_a_misspelt_key_is_refused_naming_the_real_one():
    with pytest.raises(ConfigError, match="layerwise_request_kv_gb"):
        parse_kv_transfer_config(transfer_config(layerwise_request_kv_gib=1), strict=True)
