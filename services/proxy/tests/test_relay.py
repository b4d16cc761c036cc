"""Merging children into one OpenAI response."""

from kvoffload_proxy.relay import JsonRelay, add_usage, remap


async def test_json_merge_orders_choices_and_sums_usage():
    """Children are choices: child i * n + j is choice j of prompt i; each prompt's tokens count once."""
    relay = JsonRelay("cmpl-p", {}, n=2)
    for child in (3, 1, 0, 2):
        await relay.add(
            child,
            {
                "id": f"d{child}",
                "object": "text_completion",
                "choices": [{"index": 0, "text": f"c{child}"}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
                "kv_transfer_params": {"secret": 1},
            },
        )
    merged = relay.merged()
    assert merged["id"] == "cmpl-p" and "kv_transfer_params" not in merged
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "c0"), (1, "c1"), (2, "c2"), (3, "c3")]
    assert merged["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16}


def test_remap_tolerates_odd_shapes():
    assert remap({"choices": "x"}, 1, 1, "id")["choices"] == "x"
    assert remap({"choices": [{"index": "a"}, 3]}, 1, 1, "id")["choices"] == [{"index": 1}, 3]
    assert add_usage(None, None) is None
    assert add_usage({"a": 1}, {"a": 2, "details": None}) == {"a": 3, "details": None}
