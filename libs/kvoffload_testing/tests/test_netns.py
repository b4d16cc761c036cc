"""``veth_namespace``: two pairs made at once get distinct subnets (real namespaces; needs root)."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

from kvoffload_testing.netns import IP, in_namespace, veth_namespace


def test_pairs_made_at_once_get_subnets_of_their_own_and_each_namespace_answers_on_its_own():
    with ExitStack() as stack, ThreadPoolExecutor(3) as pool:
        veths = list(pool.map(lambda _: stack.enter_context(veth_namespace()), range(3)))
        assert len({v.here for v in veths} | {v.there for v in veths}) == 6, veths
        for v in veths:  # each far end is in its own namespace
            show = in_namespace(v.name, [IP, "-o", "-4", "addr", "show"])
            assert f" {v.there}/30" in subprocess.run(show, check=True, capture_output=True, text=True).stdout
    held = subprocess.run([IP, "-o", "-4", "addr", "show"], check=True, capture_output=True, text=True).stdout
    assert not any(f" {v.here}/" in held for v in veths), held  # removed after
