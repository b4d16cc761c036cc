"""`kvoffload trace record` on the real SmolLM2-135M-Instruct (a short recording written with --out),
then `kvoffload trace show` reading it back by name from a trace cache ($KVOFFLOAD_HOME/traces)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_support import smollm2_dir

from kvcore.traces.trace import Trace

KVOFFLOAD = str(Path(sys.executable).parent / "kvoffload")


def test_record_and_show_a_real_trace(tmp_path):
    smollm2_dir()  # built once per machine under the default home, where `trace record` finds it
    out = tmp_path / "traces" / "smollm2.pt"
    done = subprocess.run(
        [
            KVOFFLOAD,
            "trace",
            "record",
            "smollm2",
            "--context",
            "512",
            "--steps",
            "4",
            "--topk",
            "16",
            "--requests",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout

    trace = Trace.load(out)
    assert trace.topk.shape == (30 * 3, 4, 16) and trace.context0.tolist() == [512] * 90
    assert trace.meta["kind"] == "recorded" and trace.meta["model_provenance"]["model"].startswith("SmolLM2")
    assert trace.meta["generated"][0].strip()  # the model wrote something

    shown = subprocess.run(
        [KVOFFLOAD, "trace", "show", "smollm2"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "KVOFFLOAD_HOME": str(tmp_path)},
    )
    assert shown.returncode == 0, shown.stderr
    figures = json.loads(shown.stdout)
    assert (figures["streams"], figures["steps"], figures["k"]) == (90, 4, 16)
    assert 0 < figures["overlap"] <= 1 and len(figures["overlap_by_layer"]) == 30
