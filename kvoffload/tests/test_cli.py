"""The CLI parses its subcommands and refuses unknown benchmarks."""

import pytest

from kvoffload.cli import build_parser
from kvoffload.cli_bench import BENCHES


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


@pytest.mark.parametrize(
    ("result", "status", "says"),
    [
        ({"goals_met": {"speed": True, "tokens_equal": True}}, 0, "every goal met"),
        ({"goals_met": {"speed": True, "tokens_equal": False}}, 3, "goals not met: tokens_equal"),
        (
            {"goals_met": {"speed": False}, "not_measured": {"speed": "one chunk"}},
            3,
            "goals not met: speed (not measured: one chunk)",
        ),
        ({"goal_met": True}, 0, "every goal met"),  # kvoffload bench faults' single verdict
        ({"goal_met": False}, 3, "goals not met: goal_met"),
        ({"goals_met": {"speed": True}, "goal_met": False}, 3, "goals not met: goal_met"),
        ({"figure": 1.0}, 1, "neither goals_met nor goal_met"),
        ({"goals_met": {}}, 1, "not a non-empty dict"),
        ({"goals_met": {"speed": None}}, 1, "not a non-empty dict"),
        ({"goal_met": 1}, 1, "not true/false"),
    ],
)
def test_bench_exit_status_says_whether_the_goals_were_met(monkeypatch, capsys, result, status, says):
    import json

    from kvoffload import cli, cli_bench

    monkeypatch.setattr(cli_bench, "_load", lambda target: lambda: result)
    assert cli.main(["bench", "prefix", "--json"]) == status
    out, err = capsys.readouterr()
    assert json.loads(out) == result  # the JSON is printed whatever the verdict
    assert f"kvoffload bench prefix: {'error: ' if status == 1 else ''}" in err and says in err


def test_every_bench_judges_goals_a_result_without_any_is_an_error(monkeypatch, capsys):
    from kvoffload import cli, cli_bench

    monkeypatch.setattr(cli_bench, "_load", lambda target: lambda: {"bench": "pool"})
    assert cli.main(["bench", "pool", "--json"]) == 1
    monkeypatch.setattr(cli_bench, "_load", lambda target: lambda: {"bench": "pool", "goals_met": {"rate": False}})
    assert cli.main(["bench", "pool", "--json"]) == 3


def test_bench_help_documents_the_exit_statuses(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for line in ("exit status:", "  0  every goal", "  1  error", "  2  usage error", "  3  goals not met"):
        assert line in out


def _make_bench_recipe() -> str:
    """The recipe of the Makefile's bench target (its lines after ``bench: ...``)."""
    from pathlib import Path

    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    return makefile[makefile.index("\nbench:") :].split("\n\n")[0].split("\n", 2)[2]


def test_make_bench_names_every_bench():
    import re

    recipe = _make_bench_recipe()
    names = re.search(r"for b in ([\w ]+); do", recipe).group(1).split()
    assert sorted(names) == sorted(BENCHES) and len(names) == len(set(names))
    assert not re.findall(r"0:(\w+)\)", recipe)  # no bench without goals


def test_make_bench_runs_every_bench_after_a_failure_and_prints_a_summary(tmp_path):
    """The bench target's recipe, with a stand-in for ``kvoffload`` that exits as a bench would:
    prefill misses a goal (3), load fails (1), the rest pass; every bench still runs, the summary
    says which is which, and make fails."""
    import subprocess

    fake = tmp_path / "kvoffload"
    fake.write_text(
        '#!/bin/sh\necho "ran $2" >> "$(dirname "$0")/ran"\necho \'{"bench": "\'"$2"\'"}\'\n'
        'case "$2" in prefill) exit 3;; load) exit 1;; esac\n'
    )
    fake.chmod(0o755)
    recipe = _make_bench_recipe().replace(".venv/bin/kvoffload", str(fake))
    (tmp_path / "Makefile").write_text(f"bench:\n{recipe}\n")
    proc = subprocess.run(["make", "-s", "-C", str(tmp_path), "bench"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert (tmp_path / "ran").read_text().split("\n")[:-1] == [f"ran {b}" for b in _make_bench_order(recipe)]
    assert len(proc.stdout.splitlines()) == len(BENCHES)  # each bench's JSON
    summary = [
        line
        for line in proc.stderr[proc.stderr.index("kvoffload bench summary:") :].splitlines()
        if line.startswith("  ")
    ]  # make adds its own error line after it
    assert len(summary) == len(BENCHES)
    assert "  prefill: goals not met" in summary and "  load: error (exit 1)" in summary
    assert "  pool: goals met" in summary and "  decode: goals met" in summary


def _make_bench_order(recipe: str) -> list[str]:
    import re

    return re.search(r"for b in ([\w ]+); do", recipe).group(1).split()


def test_plot_and_prompts_go_only_to_a_bench_that_takes_them(capsys):
    from kvoffload.cli import main

    assert main(["bench", "prefix", "--plot", "/tmp/never"]) == 2
    assert "this bench takes no --plot" in capsys.readouterr().err
    assert main(["bench", "hotcache", "--prompts", "3"]) == 2
    assert "this bench takes no --prompts" in capsys.readouterr().err
    import inspect

    from kvoffload.cli_bench import BENCHES, _load

    assert {"plot", "prompts"} <= set(inspect.signature(_load(BENCHES["quality"])).parameters)
