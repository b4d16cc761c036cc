"""``kvoffload model init`` writes a loadable tiny model, byte-identical for the same seed."""

import hashlib

from kvoffload.cli import main


def _digest(d):
    return hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()


def test_model_init_is_deterministic(tmp_path, capsys):
    from dsamodel.weights import load_model

    assert main(["model", "init", "--preset", "tiny", "--out", str(tmp_path / "a")]) == 0
    assert main(["model", "init", "--preset", "tiny", "--out", str(tmp_path / "b")]) == 0
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert (tmp_path / "a" / "model.safetensors").stat().st_size < 8 << 20
    model = load_model(tmp_path / "a")
    assert model.config.num_hidden_layers >= 4 and model.config.num_nextn_predict_layers == 1
