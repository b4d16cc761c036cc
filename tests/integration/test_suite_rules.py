"""The suite's own rules (the root conftest.py and pyproject's pytest options), run on small inner
suites: a skip for a missing dependency fails, a skip for missing hardware stays a skip, an unknown
marker is an error, and a hang fails at the per-test timeout with a traceback."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    """An inner suite that runs under the repository's conftest.py and pytest options."""
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makeini(
        "[pytest]\naddopts = --strict-markers -rs\ntimeout = 300\nxfail_strict = true\n"
        "markers =\n    slow: slow\n    stack: stack\n    vllm: vllm\n"
    )
    return pytester


def test_a_skip_for_a_missing_package_fails_with_its_reason(suite):
    suite.makepyfile("""
        import pytest
        def test_needs_a_package():
            pytest.importorskip("surely_not_installed_here")
    """)
    result = suite.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*not missing hardware*surely_not_installed_here*"])


def test_a_skip_for_no_docker_engine_fails(suite):
    suite.makepyfile("""
        import pytest
        pytestmark = pytest.mark.skipif(True, reason="no Docker engine answers at unix:///var/run/docker.sock")
        def test_containers():
            pass
    """)
    suite.runpytest().assert_outcomes(errors=1)  # skipped while setting up: an error, which fails the run


def test_a_skip_for_missing_hardware_stays_a_skip_and_prints_its_reason(suite):
    suite.makepyfile("""
        import pytest
        def test_npu():
            pytest.skip("memcache data path needs an Ascend driver: libascendcl.so not found")
    """)
    result = suite.runpytest()
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*needs an Ascend driver*"])


def test_a_module_skipped_at_collection_for_a_missing_package_fails(suite):
    suite.makepyfile("""
        import pytest
        pytest.importorskip("surely_not_installed_here")
        def test_never_collected():
            pass
    """)
    result = suite.runpytest()
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*not missing hardware*surely_not_installed_here*"])
    assert "1 skipped" not in result.stdout.str()


def test_a_module_skipped_at_collection_for_missing_hardware_stays_a_skip(suite):
    suite.makepyfile("""
        import pytest
        pytest.skip("needs an Ascend driver: libascendcl.so not found", allow_module_level=True)
    """)
    result = suite.runpytest()
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result.stdout.fnmatch_lines(["SKIPPED*needs an Ascend driver*"])


def test_an_xfail_that_passes_fails_the_run(suite):
    suite.makepyfile("""
        import pytest
        @pytest.mark.xfail(reason="fixed since")
        def test_fixed():
            assert True
    """)
    suite.runpytest().assert_outcomes(failed=1)


def test_a_hang_the_timeout_signal_cannot_end_is_ended_by_the_watchdog_with_every_threads_traceback(suite):
    """A test blocked where pytest-timeout's SIGALRM never runs its handler (here: the signal blocked,
    as a native call that never returns to the interpreter) is ended by the faulthandler watchdog at its
    timeout plus the grace, with a traceback, instead of running out CI's clock."""
    conftest = (ROOT / "conftest.py").read_text()
    suite.makeconftest(conftest.replace("NATIVE_HANG_GRACE_S = 60", "NATIVE_HANG_GRACE_S = 1"))
    suite.makepyfile("""
        import signal, time
        import pytest
        @pytest.mark.timeout(1)
        def test_hangs_in_native_code():
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
            time.sleep(120)
    """)
    t0 = time.monotonic()
    result = suite.runpytest_subprocess(timeout=60)
    assert time.monotonic() - t0 < 30
    assert result.ret != 0
    assert "Timeout" in result.stderr.str() and "test_hangs_in_native_code" in result.stderr.str(), result.stderr.str()


def test_each_modules_set_up_time_is_printed_at_the_end(suite, monkeypatch):
    # the inner run is in this process: under xdist it would inherit this worker's variable and take
    # itself for a worker, which leaves the summary to its controller
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    suite.makepyfile(
        test_slow_setup="""
        import time
        import pytest
        @pytest.fixture(scope="module")
        def server():
            time.sleep(0.3)
        def test_a(server):
            pass
        def test_b(server):
            pass
    """
    )
    result = suite.runpytest()
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*set-up time per test module*", "*0.[3-9] s  test_slow_setup.py"])


def test_an_xfail_is_left_alone(suite):
    suite.makepyfile("""
        import pytest
        @pytest.mark.xfail(reason="known", strict=True)
        def test_known():
            assert False
    """)
    suite.runpytest().assert_outcomes(xfailed=1)


def test_an_unknown_marker_is_an_error(suite):
    suite.makepyfile("""
        import pytest
        @pytest.mark.slwo
        def test_typo():
            pass
    """)
    result = suite.runpytest()
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*'slwo' not found in `markers`*"])


def test_a_hang_fails_at_the_timeout_with_a_traceback(suite):
    suite.makepyfile("""
        import time
        import pytest
        @pytest.mark.timeout(1)
        def test_hangs():
            time.sleep(60)
    """)
    result = suite.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*time.sleep(60)*", "*Timeout*"])


def test_server_tests_get_the_longer_timeout_of_their_marker_unless_they_name_one(suite):
    suite.makepyfile("""
        import pytest
        def timeout(request):
            return request.node.get_closest_marker("timeout").args[0]
        @pytest.mark.stack
        def test_stack(request):
            assert timeout(request) == 900
        @pytest.mark.vllm
        def test_vllm(request):
            assert timeout(request) == 1200
        @pytest.mark.vllm
        @pytest.mark.timeout(42)
        def test_own(request):
            assert timeout(request) == 42
    """)
    suite.runpytest().assert_outcomes(passed=3)


def test_under_xdist_a_module_runs_on_one_worker_and_the_vllm_modules_share_one(suite):
    for name in ("a", "b", "c"):
        suite.makepyfile(
            **{
                f"test_{name}": f"""
            import pytest
            {"pytestmark = pytest.mark.vllm" if name != "c" else ""}
            @pytest.mark.parametrize("i", range(4))
            def test_worker(worker_id, i):
                with open("workers.txt", "a") as f:
                    f.write("{name} " + worker_id + "\\n")
        """
            }
        )
    suite.runpytest("-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder").assert_outcomes(passed=12)
    seen: dict[str, set[str]] = {}
    for module, worker in (line.split() for line in (suite.path / "workers.txt").read_text().splitlines()):
        seen.setdefault(module, set()).add(worker)
    assert all(len(workers) == 1 for workers in seen.values()), seen
    assert seen["a"] == seen["b"], seen  # the vLLM modules: one group


def test_the_repository_runs_under_these_rules():
    """The inner suites above copy what the repository's pytest options say: keep them in step."""
    text = (ROOT / "pyproject.toml").read_text()
    assert '--strict-markers -rs"' in text and "\ntimeout = " in text and "\nxfail_strict = true" in text
