"""``kvoffload up`` / ``kvoffload demo`` on the command line (``kvoffload.cli_stack``): the flags the
vLLM engine refuses, the defaults per engine, which stack each engine builds, and what each demo
prints."""

from __future__ import annotations

import json

import pytest

from kvoffload import cli, cli_stack
from kvoffload_testing.stack import Stack
from kvoffload_testing.vllm_stack import DEFAULT_MAX_MODEL_LEN, VllmStack


@pytest.mark.parametrize("command", ["up", "demo"])
@pytest.mark.parametrize("flags", [["--tls-cert", "c.pem", "--tls-key", "k.pem"], ["--tls-ca", "ca.pem"]])
def test_reference_only_flags_are_refused_with_the_vllm_engine(command, flags, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--engine", "vllm", "--model", "/nonexistent", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"kvoffload {command}: error: " in err and "only with --engine reference" in err
    assert all(f in err for f in flags if f.startswith("--"))


def test_an_unknown_engine_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["up", "--engine", "sglang"])
    assert exc.value.code == 2 and "invalid choice: 'sglang'" in capsys.readouterr().err


def test_the_vllm_engine_without_vllm_installed_says_how_to_install_it(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--engine", "vllm", "--model", "/nonexistent"])
    assert exc.value.code == 2 and "make install-vllm" in capsys.readouterr().err


def test_max_model_len_defaults_per_engine(tmp_path):
    def cfg(*argv):
        args = cli.build_parser().parse_args(["up", "--model", str(tmp_path), "--log-dir", str(tmp_path), *argv])
        return cli_stack.stack_config(args)

    assert cfg().max_model_len == cli_stack.REFERENCE_MAX_MODEL_LEN == 16384
    assert cfg("--engine", "vllm").max_model_len == cli_stack.VLLM_MAX_MODEL_LEN == DEFAULT_MAX_MODEL_LEN
    assert cfg("--engine", "vllm", "--max-model-len", "1024").max_model_len == 1024
    assert cfg("--engine", "vllm").model == tmp_path and cfg("--engine", "vllm").tls is None


def test_the_reference_engine_is_the_default_and_builds_the_reference_stack(tmp_path):
    args = cli.build_parser().parse_args(["up", "--model", str(tmp_path)])
    assert args.engine == "reference"
    assert type(cli_stack.make_stack(args, cli_stack.stack_config(args))) is Stack
    args = cli.build_parser().parse_args(["up", "--engine", "vllm", "--model", str(tmp_path)])
    assert type(cli_stack.make_stack(args, cli_stack.stack_config(args))) is VllmStack


@pytest.mark.parametrize("model", [None, "tiny"])
def test_the_reference_demo_prints_the_question_or_says_the_tiny_text_is_meaningless(
    tmp_path, monkeypatch, capsys, model
):
    import kvoffload_testing.reference_demo as rd
    import kvoffload_testing.stack_config as stack_config
    from kvoffload_testing import model_indexer

    seen = {}

    def fake_run_demo(cfg, max_tokens):
        seen.update(cfg=cfg, max_tokens=max_tokens)
        return "The Apache License 2.0.", {"prompt_tokens": 2270, "completion_tokens": 9, "seconds": 1.0}

    monkeypatch.setattr(rd, "run_demo", fake_run_demo)
    monkeypatch.setattr(stack_config, "ensure_tiny_model", lambda path: tmp_path / "tiny")
    monkeypatch.setattr(model_indexer, "served_model", lambda name, log=print: tmp_path / name)
    argv = ["demo", "--log-dir", str(tmp_path), *(["--model", model] if model else [])]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert seen["cfg"].model == tmp_path / (model or "smollm2") and seen["max_tokens"] == rd.DEFAULT_MAX_TOKENS
    if model == "tiny":
        assert "meaningless" in out[0]
    else:
        assert rd.DEMO_QUESTION in out[0] and "2270-token prompt" in out[0]
    assert "'The Apache License 2.0.'" in out[1] and json.loads(out[2])["completion_tokens"] == 9


def test_the_vllm_demo_prints_the_question_the_answer_and_the_summary(tmp_path, monkeypatch, capsys):
    import kvoffload_testing.vllm_demo as vs

    seen = {}

    def fake_run_demo(cfg, max_tokens):
        seen.update(cfg=cfg, max_tokens=max_tokens)
        return "An answer.", {"prompt_tokens": 300, "completion_tokens": 3, "seconds": 1.0}

    monkeypatch.setattr(vs, "run_demo", fake_run_demo)
    assert cli.main(["demo", "--engine", "vllm", "--model", str(tmp_path), "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert vs.DEMO_QUESTION in out[0] and "'An answer.'" in out[1] and json.loads(out[2])["completion_tokens"] == 3
    assert seen["max_tokens"] == vs.DEFAULT_MAX_TOKENS and seen["cfg"].model == tmp_path
    assert not any("meaningless" in line for line in out)
