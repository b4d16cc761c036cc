"""``kvoffload bench quality --plot DIR``: the bench's curves as PNG files (matplotlib, no display).

- ``recall_vs_k.png``: the indexer's median recall against k, one line per context length, the
  goal as a dashed line;
- ``tpot_vs_context.png``: decode TPOT at batch 1 against the context length for each system the
  speed half measured (sparse offload, dense, plain vLLM); absent when speed was not measured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plots(result: dict[str, Any], out_dir: str) -> list[str]:
    """The PNG files written for ``result`` (``kvoffload_bench.quality.run``'s) into ``out_dir``."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'kvoffload[bench]' (scripts/bootstrap does)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for ctx, curve in result["recall_by_k"].items():
        ks = sorted(int(k) for k in curve)
        ax.plot(ks, [curve[str(k)] for k in ks], marker="o", label=f"context {ctx}")
    ax.axhline(result["goals"]["indexer_recall"], linestyle="--", color="grey", label="goal")
    ax.set(xscale="log", xlabel="k (tokens selected per query)", ylabel="attention mass kept (median)")
    ax.set_title("PCA indexer recall on SmolLM2")
    ax.legend()
    written.append(_save(fig, out / "recall_vs_k.png"))
    speed = result.get("speed")
    if speed and speed.get("tpot_s"):
        fig, ax = plt.subplots(figsize=(6, 4))
        names = list(speed["tpot_s"])
        systems = sorted({s for per in speed["tpot_s"].values() for s in per})
        for system in systems:
            xs = [n for n in names if system in speed["tpot_s"][n]]
            ax.plot(xs, [speed["tpot_s"][n][system] * 1e3 for n in xs], marker="o", label=system)
        ax.set(xlabel="context", ylabel="decode TPOT at batch 1 (ms)")
        ax.set_title("Decode time per token, side by side")
        ax.legend()
        written.append(_save(fig, out / "tpot_vs_context.png"))
    return written


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
