"""The store connector's scheduler-side bookkeeping, without vLLM: lookups ask the pool once and
leave a token to compute; a promised hit is loaded once, into the right vLLM blocks; every prompt
block is saved exactly once, in the step that completes it, never a hit block."""

from __future__ import annotations

from kvcore.pool.block_keys import block_keys
from kvoffload_vllm.plan import StorePlanner

BS = 4
MODEL = "vllm:test:0"


def _pool(present: set[bytes]):
    calls = []

    def exists(keys):
        calls.append(list(keys))
        return [k in present for k in keys]

    return exists, calls


def test_lookup_is_the_leading_run_beyond_the_local_hit_and_leaves_a_token():
    prompt = list(range(17))  # 4 full blocks + 1 token
    keys = block_keys(MODEL, prompt, BS)
    exists, calls = _pool(set(keys))
    plan = StorePlanner(MODEL, BS)
    assert plan.lookup("r", prompt, 0, exists) == 16 and calls == [keys]
    exists, calls = _pool(set(keys[:2]) | {keys[3]})  # a hole at block 2: the run stops there
    assert plan.lookup("r", prompt, 0, exists) == 8
    assert plan.lookup("r", prompt, 4, exists) == 4 and calls[-1] == keys[1:4]  # beyond the local hit only
    exact = list(range(16))  # 4 full blocks exactly: the last one must be computed
    exists, calls = _pool(set(block_keys(MODEL, exact, BS)))
    assert plan.lookup("x", exact, 0, exists) == 12 and len(calls[0]) == 3
    exists, calls = _pool(set())
    assert plan.lookup("y", [1, 2, 3], 0, exists) == 0 and calls == []  # no full block: no call at all


def test_a_hit_is_loaded_once_and_the_prompt_is_saved_block_by_block_as_chunks_complete():
    prompt = list(range(30))  # 7 full blocks + 2 tokens
    keys = block_keys(MODEL, prompt, BS)
    plan = StorePlanner(MODEL, BS)
    exists, _ = _pool(set(keys[:3]))
    assert plan.lookup("r", prompt, 4, exists) == 8  # local hit: block 0; the pool: blocks 1, 2
    plan.allocated("r", 8)
    # first chunk: 12 computed (4 local + 8 loaded), 10 scheduled -> 22 computed: blocks 3, 4 complete
    load, save = plan.new_request("r", prompt, [10, 11, 12, 13, 14, 15], 12, 10)
    assert (load.keys, load.block_ids) == (tuple(keys[1:3]), (11, 12))
    assert (save.keys, save.block_ids) == (tuple(keys[3:5]), (13, 14))
    # second chunk: two more blocks allocated, the rest of the prompt (8 tokens) -> blocks 5, 6
    save = plan.running_request("r", [16, 17], False, 22, 8)
    assert (save.keys, save.block_ids) == (tuple(keys[5:7]), (15, 16))
    assert plan.running_request("r", None, False, 30, 1) is None  # decoding: nothing to save
    plan.finished("r")
    assert len(plan) == 0 and plan.running_request("r", None, False, 31, 1) is None


def test_a_resumed_request_saves_from_what_it_recomputes():
    prompt = list(range(12))
    keys = block_keys(MODEL, prompt, BS)
    plan = StorePlanner(MODEL, BS)
    _, save = plan.new_request("r", prompt, [1, 2, 3], 0, 8)
    assert save.keys == tuple(keys[:2])
    save = plan.running_request("r", [7, 8, 9], True, 0, 12)  # preempted: all blocks anew, all recomputed
    assert (save.keys, save.block_ids) == (tuple(keys), (7, 8, 9))


def test_scheduled_requests_reads_new_then_running_requests_of_a_scheduler_step():
    from types import SimpleNamespace

    from kvoffload_vllm.plan import Scheduled, scheduled_requests

    out = SimpleNamespace(
        num_scheduled_tokens={"a": 128, "b": 1, "c": 5},
        scheduled_new_reqs=[
            SimpleNamespace(req_id="a", prompt_token_ids=[1, 2], block_ids=([3, 4], [5, 0]), num_computed_tokens=0)
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["b", "c"], new_block_ids=[None, ([9], [])], resumed_req_ids={"c"}, num_computed_tokens=[130, 7]
        ),
    )
    assert list(scheduled_requests(out)) == [
        Scheduled("a", True, False, [1, 2], ([3, 4], [5, 0]), 0, 128),  # every KV cache group's blocks
        Scheduled("b", False, False, None, None, 130, 1),
        Scheduled("c", False, True, None, ([9], []), 7, 5),
    ]


def test_a_sliding_window_groups_null_blocks_are_neither_loaded_nor_saved():
    """A sliding-window group's blocks before the window are vLLM's null block (0): a hit loads only
    the blocks after them, with their positions; a resumed request saves none of them."""
    prompt = list(range(20))
    keys = block_keys(MODEL, prompt, BS)
    plan = StorePlanner(MODEL, BS, group=1)
    assert plan.lookup("r", prompt, 0, lambda ks: [True] * len(ks)) == 16
    plan.allocated("r", 16)
    load, save = plan.new_request("r", prompt, [0, 0, 7, 8, 9], 16, 4)
    assert (load.keys, load.block_ids, load.start, load.group) == (tuple(keys[2:4]), (7, 8), 2, 1)
    assert (save.keys, save.block_ids, save.start) == ((keys[4],), (9,), 4)
    assert plan.running_request("r", [0, 0, 0, 0, 3], True, 0, 16) is None  # only nulls before the recompute's end
    save = plan.running_request("r", None, False, 16, 4)
    assert (save.block_ids, save.start) == ((3,), 4)
