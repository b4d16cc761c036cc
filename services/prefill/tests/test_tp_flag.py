"""--tensor-parallel-size on the prefill: a size the model cannot be sharded over, or one below 1,
and TP in offload-only mode or with memfabric exit 2 with a message naming the flag and both values, before any rank
process starts. (The running TP prefill: tests/integration/test_tp_stack.py.)"""

import json

import pytest

from dsamodel.presets import write_tiny
from kvoffload_prefill.server import main

STORE = {
    "backend": "kvoffload",
    "use_layerwise": True,
    "layerwise_num_shared_buffers": 2,
    "layerwise_independent_layers": [0],
    "host_pool_gb": 0.0625,
}
PD = json.dumps(
    {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "SfaRemoteD2HConnector",
                    "kv_role": "kv_producer",
                    "kv_port": 20999,
                    "kv_connector_extra_config": {"transfer_backend": "kvoffload"},
                },
                {"kv_connector": "AscendStoreConnector", "kv_role": "kv_producer", "kv_connector_extra_config": STORE},
            ]
        },
    }
)
OFFLOAD_ONLY = json.dumps(
    {"kv_connector": "AscendStoreConnector", "kv_role": "kv_producer", "kv_connector_extra_config": STORE}
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("tiny") / "tiny"))


@pytest.mark.parametrize(
    "config, size, message",
    [
        (PD, "3", "--tensor-parallel-size: tensor parallel size 3 does not divide the model's num_attention_heads=4"),
        (PD, "0", "--tensor-parallel-size"),
        (
            OFFLOAD_ONLY,
            "2",
            "--tensor-parallel-size: got 2; offload-only mode (no SfaRemoteD2HConnector) runs one rank",
        ),
        (
            PD.replace('"transfer_backend": "kvoffload"', '"transfer_backend": "memfabric"'),
            "2",
            "--tensor-parallel-size: got 2; with transfer_backend 'memfabric' the prefill runs one rank",
        ),
    ],
)
def test_a_size_that_cannot_work_exits_2_naming_it(capsys, tiny, config, size, message):
    assert (
        main(
            ["--model", tiny, "--kv-transfer-config", config, "--max-model-len", "256", "--tensor-parallel-size", size]
        )
        == 2
    )
    assert message in capsys.readouterr().err


def test_a_rank_that_cannot_start_ends_the_wait_at_once_naming_it(tmp_path):
    """Rank 1 cannot load its model (here: a directory that does not exist): rank 0 stops waiting
    for the group as soon as that process exits, with a StartupError naming the rank and its exit
    code, and leaves no process behind. In a child interpreter: the join is process-global."""
    import subprocess
    import sys
    import time

    script = (
        "import sys\n"
        "from dsamodel.presets import tiny_model\n"
        "from svcruntime.serving import StartupError\n"
        "from kvoffload_prefill.tp_ranks import TPRanks\n"
        "try:\n"
        f"    TPRanks.start(tiny_model(), model_dir={str(tmp_path / 'missing')!r}, dtype=None, size=2, "
        "log_level='error')\n"
        "except StartupError as exc:\n"
        "    print('STARTUP', exc)\n"
        "    sys.exit(0)\n"
        "sys.exit(1)\n"
    )
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.stdout, run.stderr[-2000:])
    assert "STARTUP --tensor-parallel-size 2: TP rank 1 exited with code 1 before it joined the group" in run.stdout
    assert time.monotonic() - t0 < 60
