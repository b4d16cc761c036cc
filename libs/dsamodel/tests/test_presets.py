"""The tiny preset: deterministic bytes, a few MB, loadable, well-scaled activations."""

import hashlib

import torch

from dsamodel.config import ModelConfig
from dsamodel.dense_reference import forward_hidden
from dsamodel.presets import tiny_config, tiny_model, write_tiny
from dsamodel.tokenizer import ByteTokenizer
from dsamodel.weights import load_model

FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


def _digests(path):
    return {name: hashlib.sha256((path / name).read_bytes()).hexdigest() for name in FILES}


def test_same_seed_writes_identical_bytes(tmp_path):
    a, b, c = (write_tiny(tmp_path / d, seed=s) for d, s in (("a", 0), ("b", 0), ("c", 1)))
    assert _digests(a) == _digests(b)
    assert _digests(a)["model.safetensors"] != _digests(c)["model.safetensors"]
    size = (a / "model.safetensors").stat().st_size
    assert 1_000_000 < size < 8_000_000


def test_written_preset_loads(tmp_path):
    out = write_tiny(tmp_path, seed=0, dtype="bfloat16")
    cfg = ModelConfig.from_json(out)
    assert cfg == tiny_config(dtype="bfloat16")
    assert cfg.num_hidden_layers == 4 and cfg.num_nextn_predict_layers == 1 and cfg.index_topk == 64
    model = load_model(out)
    assert model.dtype == torch.bfloat16
    reference = tiny_model(seed=0).to(torch.bfloat16)
    got, want = model.state_dict(), reference.state_dict()
    assert list(got) == list(want)  # every tensor, by name: a zip of the two would stop at the shorter
    for name, p in got.items():
        assert torch.equal(p, want[name]), name
    fp32 = write_tiny(tmp_path / "fp32", seed=0, dtype="float32")
    assert load_model(fp32).dtype == torch.float32
    assert ByteTokenizer.from_dir(out).vocab_size == cfg.vocab_size


def test_activations_stay_well_scaled(model_fp32, prompt):
    h = forward_hidden(model_fp32, prompt(256))
    assert 0.5 < float(h.std()) < 2.0
