"""--tensor-parallel-size on the decode: a size the model cannot be sharded over, one below 1, and
TP with memfabric exit 2 with a message naming the flag and the values, before any rank process
starts. (The running TP decode: tests/integration/test_tp_decode_stack.py.)"""

import json

import pytest

from dsamodel.presets import write_tiny
from kvoffload_decode.server import main


def _kv(backend: str) -> str:
    return json.dumps(
        {
            "kv_connector": "SfaRemoteD2HConnector",
            "kv_role": "kv_consumer",
            "kv_port": 20999,
            "kv_connector_extra_config": {"transfer_backend": backend},
        }
    )


SPARSE = json.dumps({"sparse_kv_offload_config": {"enabled": True, "topk_buffer_size": 128, "dram_size_per_dp_GB": 1}})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("tiny") / "tiny"))


@pytest.mark.parametrize(
    "backend, size, message",
    [
        (
            "kvoffload",
            "3",
            "--tensor-parallel-size: tensor parallel size 3 does not divide the model's num_attention_heads=4",
        ),
        ("kvoffload", "0", "--tensor-parallel-size"),
        ("memfabric", "2", "--tensor-parallel-size: got 2; with transfer_backend 'memfabric' the decode runs one rank"),
    ],
)
def test_a_size_that_cannot_work_exits_2_naming_it(capsys, tiny, backend, size, message):
    assert (
        main(
            [
                "--model",
                tiny,
                "--kv-transfer-config",
                _kv(backend),
                "--additional-config",
                SPARSE,
                "--max-model-len",
                "256",
                "--tensor-parallel-size",
                size,
            ]
        )
        == 2
    )
    assert message in capsys.readouterr().err
