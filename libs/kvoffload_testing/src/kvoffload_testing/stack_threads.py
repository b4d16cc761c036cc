"""The OpenMP settings of a loopback stack's reference services, which share one host's cores."""

from __future__ import annotations

from collections.abc import Mapping


def colocated_threads_env(name: str, cores: int, environ: Mapping[str, str]) -> dict[str, str]:
    """OpenMP settings for reference service ``name`` when the prefills and decodes share one host's
    ``cores`` (what every stack of this module is): each would otherwise run torch with a thread per
    core and keep idle OpenMP threads spinning after every parallel region, so the decode's small,
    back-to-back steps take the cores the prefill's barriers wait for (a 2-thread prefill next to a
    busy decode ran as slowly as one thread). So: idle threads sleep at once
    (``OMP_WAIT_POLICY=PASSIVE``), and a decode gets a quarter of the cores, at least one
    (``OMP_NUM_THREADS``); the prefill keeps them all. Measured on 2 cores with ``kvoffload bench
    load`` at 64 clients: throughput ratio to the engine 0.84 and 0.85 without it, 0.88, 0.89 and 0.93
    with it (docs/design.md, "Throughput on shared cores"); on larger hosts a starting point. A
    variable already in ``environ`` (the user's) is left as it is."""
    if not name.startswith(("prefill-", "decode-")):
        return {}
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    if name.startswith("decode-"):
        env["OMP_NUM_THREADS"] = str(max(1, cores // 4))
    return {k: v for k, v in env.items() if k not in environ}
