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


def test_the_reference_demo_says_its_text_is_meaningless_and_where_real_text_is(tmp_path, monkeypatch, capsys):
    import kvoffload_testing.stack as stack_mod
    import kvoffload_testing.stack_client as client_mod

    class FakeStack:
        def __init__(self, cfg):
            self.url, self.auth_headers = "http://127.0.0.1:1", {}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    stats = {"device_kv_bytes": 1, "pool_used_bytes": 2, "bytes_read": 3, "read_done": 4, "held_slots": 0}
    monkeypatch.setattr(stack_mod, "Stack", FakeStack)
    monkeypatch.setattr(stack_mod, "ensure_tiny_model", lambda path: tmp_path)
    monkeypatch.setattr(
        client_mod,
        "post_json",
        lambda *a, **kw: {
            "choices": [{"text": "xq", "token_ids": [1, 2]}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 2},
        },
    )
    monkeypatch.setattr(
        client_mod, "stack_stats", lambda cfg: {"prefill-0": stats, "decode-0": stats, "metastore": {"objects": 1}}
    )
    assert cli.main(["demo", "--log-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if "meaningless" in line and "make demo-vllm" in line] == [lines[0]]
    assert json.loads(lines[-1])["completion_tokens"] == 2


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
