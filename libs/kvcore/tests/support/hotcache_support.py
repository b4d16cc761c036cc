"""Test support: random hot-cache step sequences (hypothesis), shared by the native-vs-reference and
the torch-vs-reference property tests of ``kvcore.hotcache.cache``."""

from hypothesis import strategies as st


@st.composite
def scenarios(draw, requests: tuple[str, ...], max_batch: int):
    """(capacity, num_layers, steps); each step: (layer, request ids, k, top-k per row, stable prefix
    per row, requests to finish, int32 ids?). Rows join, leave and reorder; top-k rows carry padding
    (-1), duplicates and speculative tokens; stable prefixes may shrink between steps."""
    capacity = draw(st.integers(1, 10))
    num_layers = draw(st.integers(1, 3))
    context = draw(st.integers(1, 3 * capacity + 2))
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        ids = draw(st.lists(st.sampled_from(requests), unique=True, max_size=max_batch))
        k = draw(st.integers(0, capacity))
        token = st.one_of(st.just(-1), st.integers(0, context + 2))
        topk = [draw(st.lists(token, min_size=k, max_size=k)) for _ in ids]
        stable = [draw(st.integers(0, context)) for _ in ids]
        finish = draw(st.lists(st.sampled_from(requests), unique=True, max_size=2))
        int32 = draw(st.booleans())
        steps.append((draw(st.integers(0, num_layers - 1)), ids, k, topk, stable, finish, int32))
    return capacity, num_layers, steps
