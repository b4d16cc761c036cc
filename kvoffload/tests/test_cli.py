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
