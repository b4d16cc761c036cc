"""Suite-wide rules every test run keeps (loaded by pytest from the repository root).

Each test gets a timeout by its markers (``MARKER_TIMEOUT_S``): a hang fails with a traceback.

Parallel runs (``make test`` and ``make check``: ``pytest -n 2 --dist loadgroup --no-loadscope-reorder``):
each test module is one xdist group, so a module's servers (module-scoped fixtures) start once, on
one worker; every module that starts vLLM servers joins one group, ``vllm`` (each such server takes
half the cores), so two modules' vLLM servers never run at once. The heaviest groups are queued first
(vLLM, then containers, then reference stacks; ``--no-loadscope-reorder`` keeps that order), and
each worker's torch runs one intra-op thread (two workers already fill the two cores).

A skip is allowed only for hardware or a platform this machine does not have (an Ascend driver,
CUDA, Linux's /proc). Any other skip — a missing package, a Docker engine that did not start, a
server that could not be launched — is a missing dependency, and the test fails with the skip's
reason instead of passing by accident; a module skipped while it is collected fails the same way.
``HARDWARE_SKIPS`` lists the reasons a skip may give.

A hang inside native code (Mooncake, memcache, vLLM's engine) never returns to the interpreter, so
pytest-timeout's signal cannot end it: a watchdog thread of the interpreter (``faulthandler``),
armed for every test at its timeout plus ``NATIVE_HANG_GRACE_S``, then dumps every thread's
traceback and ends the process (under xdist the worker: its test is reported as crashed). A run
stopped by SIGTERM (``.ci/run`` caps the whole run) dumps every thread's traceback first too.

At the end of a run, the set-up time of each test module (its fixtures' start-ups: the servers
it starts) is printed, slowest first, so the next slowdown is visible (``module_setup_times``).
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
from collections import defaultdict

import pytest
import structlog

# A skip reason must match one of these to stay a skip; each names hardware or a platform.
HARDWARE_SKIPS = (
    re.compile(
        r"Ascend driver", re.IGNORECASE
    ),  # memcache / memfabric data paths, and tests that need a host without one
    re.compile(r"\bCUDA\b"),  # tests of the CPU-only refusals on a machine that has CUDA
    re.compile(r"reads listening sockets from /proc"),  # Linux only
)


# the order groups are queued in under xdist: heavier first
GROUP_WEIGHT = {"vllm": 3, "containers": 2, "stack": 1}


def group_of(item: pytest.Item) -> tuple[str, int]:
    """(xdist group, weight) of a test: ``vllm`` for every vLLM module, else its own module."""
    if item.get_closest_marker("vllm"):
        return "vllm", GROUP_WEIGHT["vllm"]
    weight = max((w for name, w in GROUP_WEIGHT.items() if item.get_closest_marker(name)), default=0)
    return item.nodeid.split("::", 1)[0], weight


# per-test timeouts (pytest-timeout; the first test of a module pays its module's server start-ups):
# pyproject's 300 s by default, longer for the markers below, unless a test names its own
MARKER_TIMEOUT_S = {"vllm": 1200, "containers": 900, "stack": 900}


def timeout_of(item: pytest.Item) -> int | None:
    """The timeout a test's markers give it (None: pyproject's default or the test's own)."""
    if item.get_closest_marker("timeout"):
        return None
    return max((t for name, t in MARKER_TIMEOUT_S.items() if item.get_closest_marker(name)), default=None)


# past its timeout, a test whose hang the timeout's signal could not end (native code) gets this long
# before the watchdog dumps every thread and ends the process
NATIVE_HANG_GRACE_S = 60


def effective_timeout_s(item: pytest.Item) -> float | None:
    """The timeout pytest-timeout applies to ``item`` (its marker, else the ini's), None for none."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    if marker is not None and "timeout" in marker.kwargs:
        return float(marker.kwargs["timeout"])
    ini = item.config.getini("timeout")
    return float(ini) if ini not in (None, "") and float(ini) > 0 else None


# the process's own stderr, kept aside before any test's output capture takes descriptor 2 over: the
# watchdog's tracebacks must reach the terminal (or the xdist controller's stderr), not a capture file
# the process's end throws away
_hang_report_file = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """The native-hang watchdog (module docstring), armed for the test's whole protocol."""
    seconds = effective_timeout_s(item)
    if seconds is not None and _hang_report_file is not None:
        faulthandler.dump_traceback_later(seconds + NATIVE_HANG_GRACE_S, exit=True, file=_hang_report_file)
    try:
        yield
    finally:
        if seconds is not None:
            faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if (seconds := timeout_of(item)) is not None:
            item.add_marker(pytest.mark.timeout(seconds))
    if not getattr(config.option, "loadgroup", False):  # set on xdist's workers under --dist loadgroup
        return
    weights = {}
    for item in items:
        group, weights[item.nodeid] = group_of(item)
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: -weights[item.nodeid])  # stable: a module's tests keep their order


def pytest_configure(config: pytest.Config) -> None:
    global _hang_report_file
    # pytest_configure runs with the output capture suspended: descriptor 2 is the real stderr here
    _hang_report_file = os.fdopen(os.dup(2), "w")
    # a run stopped from outside (``.ci/run``'s cap on the whole run sends SIGTERM) says where every
    # thread of every pytest process stood, then ends as SIGTERM would have ended it
    faulthandler.register(signal.SIGTERM, file=_hang_report_file, all_threads=True, chain=True)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # two workers on two cores: torch's intra-op pool in each would ask for both, and OpenMP threads
        # spinning against each other made the engine tests 4-6x slower; servers a test starts are
        # other processes and keep their own settings
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _structlog_config_kept():
    """Each test starts from the structlog configuration the run had: a test that configures logging
    (a service's ``configure_logging`` at level warning, a bench) must not filter what a later test
    captures with ``structlog.testing.capture_logs`` on the same worker."""
    saved = structlog.get_config()
    saved["processors"] = list(saved["processors"])
    yield
    structlog.configure(**saved)


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason a skipped report gives (pytest keeps it as ``(path, line, "Skipped: reason")``)."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def allowed_skip(reason: str) -> bool:
    return any(p.search(reason) for p in HARDWARE_SKIPS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if allowed_skip(reason):
        return
    report.outcome = "failed"
    report.longrepr = _failed_skip(item.nodeid, reason)


def _failed_skip(nodeid: str, reason: str) -> str:
    return (
        f"{nodeid}: skipped for a reason that is not missing hardware, so it fails: {reason}\n"
        "(a missing dependency fails the run; see HARDWARE_SKIPS in the root conftest.py)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A module (or class) skipped while collected — ``pytest.importorskip`` or ``pytest.skip(...,
    allow_module_level=True)`` at its top — fails like a skipped test unless hardware is missing."""
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if not report.skipped:
        return
    reason = skip_reason(report)
    if allowed_skip(reason):
        return
    report.outcome = "failed"
    report.longrepr = _failed_skip(report.nodeid, reason)


# test module -> seconds its tests spent in set-up (module-scoped fixtures: its first test's set-up)
module_setup_times: dict[str, float] = defaultdict(float)
SETUP_TIMES_SHOWN = 15


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "setup":  # under xdist, the controller receives every worker's reports here
        module_setup_times[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not module_setup_times or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slowest = sorted(module_setup_times.items(), key=lambda kv: -kv[1])[:SETUP_TIMES_SHOWN]
    terminalreporter.section(f"set-up time per test module (the slowest {len(slowest)})")
    for module, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f} s  {module}")
