"""The vLLM test support itself, against the real thing: tiny Llama directories are deterministic per seed,
and a server that cannot start (a real vLLM server given no model) fails fast with its log, stopping
the one starting beside it (a stand-in that never answers /health: a real one would only cost a vLLM
start the test stops anyway). (A server that starts, answers greedily and leaves no process behind when
stopped: ``test_vllm_pd.py``'s plain server.)"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from vllm_support import tiny_llama_dir

from kvoffload_testing.vllm_server import VllmServer, free_port, running
from svcruntime.processgroup import group_members

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "llama", seed=0)


def test_tiny_llama_is_deterministic_per_seed(tiny, tmp_path):
    again = tiny_llama_dir(tmp_path / "again", seed=0)
    other = tiny_llama_dir(tmp_path / "other", seed=1)
    weights = (tiny / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights
    assert (again / "tokenizer.json").is_file() and (again / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".again.partial-")]
    assert tiny_llama_dir(tmp_path / "again", seed=0) == again  # complete: left as it is
    with pytest.raises(ValueError, match="seed"):
        tiny_llama_dir(tmp_path / "again", seed=2)


def test_free_port_is_below_the_ephemeral_range():
    assert all(1024 <= free_port() < 32768 for _ in range(20))


def test_servers_started_together_all_stop_when_one_cannot_start(tiny, tmp_path):
    """``running``: the server that cannot start (no model) fails fast, long before its start timeout,
    raising its own error with the last lines of its log, and the one still starting is stopped then,
    not left to finish starting."""
    timeout_s = 180.0
    good = VllmServer(tiny, log_path=tmp_path / "good.log")
    good.cmd = [sys.executable, "-c", "import time; time.sleep(600)"]  # still starting when stopped
    bad = VllmServer(tmp_path / "no-such-model", log_path=tmp_path / "bad.log", start_timeout_s=timeout_s)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="no-such-model") as info:
        with running(good, bad):
            pytest.fail("a server that cannot start was reported started")
    assert time.monotonic() - started < timeout_s
    message = str(info.value)
    assert "exited with status" in message and str(bad.url) in message
    assert "last lines of" in message and "no-such-model" in message.split("last lines of", 1)[1]
    assert good.start_s is None  # stopped while starting: it never answered /health
    assert group_members(good.proc.pid) == [] and group_members(bad.proc.pid) == []
