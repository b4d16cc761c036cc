"""Top-k traces: the workloads the hot cache, its policies and the decode engine are measured on.

- ``trace``: the ``Trace`` container (``[streams, steps, k]`` positions) and its file format;
- ``synthetic``: the seeded generator and its presets ``overlap80/90/95``;
- ``measure``: the locality a trace shows (adjacent overlap, coverage, return distance).

``named(name)`` gives a trace by name: a synthetic preset is generated (deterministic), any other
name is read from the cache (``traces_dir()/NAME.pt``), where ``kvoffload trace record NAME`` puts
traces recorded from real models.
"""

from __future__ import annotations

from kvcore.traces.synthetic import PRESETS, SyntheticParams, generate, preset
from kvcore.traces.trace import Trace, traces_dir


def named(name: str, **overrides) -> Trace:
    """The trace called ``name`` (module docstring); ``overrides`` change a preset's parameters."""
    if name in PRESETS:
        return generate(preset(name, **overrides), name)
    if overrides:
        raise ValueError(f"trace {name!r} is recorded, not generated: it takes no parameters ({sorted(overrides)})")
    path = traces_dir() / f"{name}.pt"
    if not path.exists():
        raise FileNotFoundError(
            f"trace {name!r} is not a synthetic preset ({', '.join(PRESETS)}) and {path} does not exist; "
            f"record it with `kvoffload trace record {name}`"
        )
    return Trace.load(path)


__all__ = ["PRESETS", "SyntheticParams", "Trace", "generate", "named", "preset", "traces_dir"]
