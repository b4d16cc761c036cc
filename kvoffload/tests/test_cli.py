"""The CLI parses its subcommands and refuses unknown benchmarks."""
import pytest

from kvoffload.cli import BENCHES, build_parser


def test_bench_names_resolve_to_callables():
    import importlib

    for target in BENCHES.values():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr))


def test_unknown_bench_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "nope"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_trace_is_refused_by_a_bench_that_takes_none(capsys):
    from kvoffload.cli import main

    assert main(["bench", "prefix", "--trace", "overlap90"]) == 2
    assert "this bench takes no --trace" in capsys.readouterr().err


def test_pool_is_refused_by_a_bench_that_takes_none_and_checked_by_one(capsys):
    from kvoffload.cli import main

    assert main(["bench", "prefix", "--pool", "mooncake"]) == 2
    assert "this bench takes no --pool" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "faults", "--pool", "memcache"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_a_missing_recorded_trace_says_how_to_record_it(tmp_path, monkeypatch, capsys):
    from kvoffload.cli import main

    monkeypatch.setenv("KVOFFLOAD_HOME", str(tmp_path))
    assert main(["bench", "decode", "--trace", "mine", "--json"]) == 1
    assert "kvoffload trace record mine" in capsys.readouterr().err


def test_trace_show_prints_the_locality_of_a_preset(capsys):
    import json

    from kvoffload.cli import main

    assert main(["trace", "show", "overlap95"]) == 0
    loc = json.loads(capsys.readouterr().out)
    assert abs(loc["overlap"] - 0.95) < 0.02 and loc["k"] == 2048
