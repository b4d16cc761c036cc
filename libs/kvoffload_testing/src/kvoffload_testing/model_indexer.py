"""The indexer beside a Llama model's weights: built once, with a progress bar, where it is missing.

``ensure_indexer(model_dir)`` runs ``dsamodel.indexer_build.build_indexer`` (deterministic: the same
files give the same bytes) into a temporary directory next to ``model_dir`` and moves its two files
in, the weights first and the json last (``load_model`` attaches an indexer only when both are
there, and refuses one of the two alone), under the model directory's file lock, so processes asking
at once build it once. ``served_model(name)`` is ``model_fetch.cached_model`` plus its indexer: what
``kvoffload up --model smollm2``, the demo, the tests and the benches serve.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvoffload_testing.model_fetch import cached_model


def has_indexer(model_dir: Path) -> bool:
    from dsamodel.pca_indexer import INDEXER_META, INDEXER_WEIGHTS

    return (model_dir / INDEXER_META).is_file() and (model_dir / INDEXER_WEIGHTS).is_file()


def ensure_indexer(
    model_dir: str | Path, *, force: bool = False, progress: bool = True, log: Callable[[str], None] = print
) -> bool:
    """Build the indexer of the Llama model in ``model_dir`` unless it is there (``force``: rebuild).
    Returns whether it built one. ValueError for a directory that is not a Llama model's."""
    import fcntl

    model_dir = Path(model_dir).absolute()
    _move_top_level_indexer(model_dir)
    if has_indexer(model_dir) and not force:
        return False
    with open(model_dir.parent / f".{model_dir.name}.indexer.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if has_indexer(model_dir) and not force:  # built while we waited
            return False
        start = time.monotonic()
        _build(model_dir, progress)
        log(f"built the indexer of {model_dir} in {time.monotonic() - start:.0f} s")
    return True


def _move_top_level_indexer(model_dir: Path) -> None:
    """Moves an indexer written at the directory's top level (before it had a folder of its own) into
    its folder, or removes a leftover: vLLM takes every top-level *.safetensors for weights."""
    from dsamodel.pca_indexer import INDEXER_DIR, INDEXER_META, INDEXER_WEIGHTS

    old = [model_dir / Path(name).name for name in (INDEXER_WEIGHTS, INDEXER_META)]
    if all(p.is_file() for p in old) and not has_indexer(model_dir):
        (model_dir / INDEXER_DIR).mkdir(exist_ok=True)
        for p, name in zip(old, (INDEXER_WEIGHTS, INDEXER_META), strict=True):  # the json last
            os.replace(p, model_dir / name)
    for p in old:
        p.unlink(missing_ok=True)


def _build(model_dir: Path, progress: bool) -> None:
    from tqdm import tqdm

    from dsamodel.indexer_build import build_indexer
    from dsamodel.pca_indexer import INDEXER_DIR, INDEXER_META, INDEXER_WEIGHTS

    with (
        tempfile.TemporaryDirectory(dir=model_dir.parent, prefix=f".{model_dir.name}.indexer-") as tmp,
        tqdm(total=1, desc="building the indexer", unit="step", file=sys.stderr, disable=not progress) as bar,
    ):

        def report(done: int, total: int, stage: str) -> None:
            bar.total = total
            bar.set_postfix_str(stage, refresh=False)
            bar.update(done - bar.n)

        build_indexer(model_dir, out_dir=tmp, progress=report)
        (model_dir / INDEXER_DIR).mkdir(exist_ok=True)
        for name in (INDEXER_WEIGHTS, INDEXER_META):  # the json last: with it, both are there
            os.replace(Path(tmp) / name, model_dir / name)


def served_model(name: str, log: Callable[[str], None] = print) -> Path:
    """Model ``name`` built once per machine (``cached_model``) with its indexer (``ensure_indexer``)."""
    out = cached_model(name, log)
    ensure_indexer(out, log=log)
    return out
