"""Where a Llama model's indexer lies: in its own folder, never among the weights a loader globs."""

from __future__ import annotations

from dsamodel.pca_indexer import INDEXER_META, INDEXER_WEIGHTS
from kvoffload_testing.model_indexer import _move_top_level_indexer, ensure_indexer, has_indexer


def test_an_indexer_at_the_top_level_moves_into_its_folder_and_is_not_rebuilt(tmp_path):
    (tmp_path / "kvoffload-indexer.safetensors").write_bytes(b"bases")
    (tmp_path / "kvoffload-indexer.json").write_text("{}")
    assert ensure_indexer(tmp_path, log=print) is False  # moved, so there: no build (this is no model)
    assert has_indexer(tmp_path) and [p.name for p in tmp_path.glob("*.safetensors")] == []
    assert (tmp_path / INDEXER_WEIGHTS).read_bytes() == b"bases" and (tmp_path / INDEXER_META).read_text() == "{}"


def test_a_top_level_leftover_beside_a_folder_indexer_is_removed(tmp_path):
    (tmp_path / INDEXER_WEIGHTS).parent.mkdir()
    (tmp_path / INDEXER_WEIGHTS).write_bytes(b"new")
    (tmp_path / INDEXER_META).write_text("{}")
    (tmp_path / "kvoffload-indexer.safetensors").write_bytes(b"old")
    _move_top_level_indexer(tmp_path)
    assert not (tmp_path / "kvoffload-indexer.safetensors").exists()
    assert (tmp_path / INDEXER_WEIGHTS).read_bytes() == b"new"
