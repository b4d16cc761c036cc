"""stack_stats on a stack whose service is gone: the error names the service, its address, the gRPC
status and the service's last log lines (a CI failure then says which service died and how)."""

from __future__ import annotations

import pytest

from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.stack import StackConfig
from kvoffload_testing.stack_client import StatsUnavailable, stack_stats


def test_a_service_that_does_not_answer_is_named_with_its_last_log_lines(tmp_path):
    cfg = StackConfig(model=tmp_path / "model", log_dir=tmp_path, **free_stack_ports())  # nothing listens
    (tmp_path / "metastore.log").write_text("".join(f"line {i}\n" for i in range(30)) + "killed by a test\n")
    with pytest.raises(StatsUnavailable) as got:
        stack_stats(cfg)
    text = str(got.value)
    assert text.startswith(f"metastore's Stats on 127.0.0.1:{cfg.metastore_port}: StatusCode.UNAVAILABLE"), text
    assert text.endswith("line 29\nkilled by a test\n") and "line 10\n" not in text, text
