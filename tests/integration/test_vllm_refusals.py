"""Configs vLLM must refuse at start-up, for both kvoffload connectors, with the field named.

Every refusal of the vLLM connectors in one place, paid for once per test run: the bad configs go as
far as vLLM's engine in one process that imports vLLM once (``vllm_support.refusals``), next to a
good D2H config that must build its engine the same way (the way is not vacuous); one real launch
covers the exit path of a real server (its status, its log): a D2H connector in a role it does not
take. (Tensor parallel is taken by both connectors: ``test_vllm_tp.py``; pipeline parallel is
refused: ``libs/kvoffload_vllm/tests/test_tp_config.py``.)

- Store (``AscendStoreConnector``): an unknown key, a missing metastore address, another backend, a
  role vLLM does not know, a value out of range; a metastore or a mooncake_master (backend
  ``"mooncake"``) that does not answer, its address named.
- D2H (``SfaRemoteD2HConnector``): a role it does not take, a transfer backend this machine cannot
  run, an unknown key with the near miss named, a wildcard advertise host; the guide's decode with its
  ``--additional-config`` ``sparse_kv_offload_config`` (vLLM has none: the message says where sparse
  decode runs). Every other guide key: ``test_vllm_guide_keys.py``.
"""

from __future__ import annotations

import json

import pytest
from vllm_support import failed_starts, refusals, store_config, tiny_llama_dir

from kvoffload_testing.vllm_server import VllmServer, free_port
from kvoffload_testing.vllm_stack import vllm_decode_transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BAD_CONFIGS = {  # id: (extra config, metastore, the message that names the field)
    "unknown-key": ({"metastor": "127.0.0.1:1"}, "127.0.0.1:5000", "unknown key 'metastor'; did you mean 'metastore'?"),
    "no-metastore": ({}, None, "kv_connector_extra_config.metastore: missing"),
    "other-backend": ({"backend": "memcache"}, "127.0.0.1:5000", "kv_connector_extra_config.backend: got 'memcache'"),
    "unknown-role": (
        {"role": "kv_sender"},
        "127.0.0.1:5000",
        "kv_role\n  Input should be 'kv_producer', 'kv_both' or 'kv_consumer'",
    ),  # vLLM's own check comes first
    "zero-buffers": (
        {"layerwise_num_shared_buffers": 0},
        "127.0.0.1:5000",
        "kv_connector_extra_config.layerwise_num_shared_buffers: got 0 (int); must be an int >= 1",
    ),
}


BAD_D2H_CONFIGS = {  # id: (kv-transfer-config, the message that names the field)
    "both-role": (
        {"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_both"},
        "kv_transfer_config.kv_role: got 'kv_both'",
    ),
    "memfabric": (
        {
            "kv_connector": "SfaRemoteD2HConnector",
            "kv_role": "kv_consumer",  # (vLLM itself defaults kv_port)
            "kv_connector_extra_config": {"transfer_backend": "memfabric"},
        },
        "transfer_backend: got 'memfabric'",
    ),
    "unknown-key": (
        {
            "kv_connector": "SfaRemoteD2HConnector",
            "kv_role": "kv_consumer",
            "kv_port": 20050,
            "kv_connector_extra_config": {"peer_timeout": 3},
        },
        "unknown key 'peer_timeout'; did you mean 'peer_timeout_s'?",
    ),
    "wildcard-host": (
        {
            "kv_connector": "SfaRemoteD2HConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"advertise_host": "0.0.0.0"},
        },
        "kv_connector_extra_config.advertise_host: got",
    ),
    "digests-on-the-prefill": (
        {
            "kv_connector": "SfaRemoteD2HConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"kv_digests": True},
        },
        "kv_connector_extra_config.kv_digests: the decode ('kv_consumer') logs the digests",
    ),
}


@pytest.fixture(scope="module")
def nobody() -> str:
    return f"127.0.0.1:{free_port()}"  # free: nothing listens there


def d2h_args(config: dict) -> list[str]:
    return ["--kv-transfer-config", json.dumps({**config, "kv_connector_module_path": "kvoffload_vllm"})]


@pytest.fixture(scope="module")
def refused(tmp_path_factory, nobody) -> dict[str, tuple[str, str]]:
    """Every start-up of this module: (error, log) by case (store cases by their name, D2H ones as
    ``d2h-<name>``)."""
    tmp = tmp_path_factory.mktemp("refused")
    model = tiny_llama_dir(tmp / "tiny")
    cases = {
        name: ["--kv-transfer-config", store_config(metastore, **extra)]
        for name, (extra, metastore, _) in BAD_CONFIGS.items()
    }
    cases |= {f"d2h-{name}": d2h_args(config) for name, (config, _) in BAD_D2H_CONFIGS.items() if name != "both-role"}
    cases["nobody"] = ["--kv-transfer-config", store_config(nobody)]
    cases["nobody-mooncake"] = ["--kv-transfer-config", store_config(None, backend="mooncake", mooncake_master=nobody)]
    cases["sparse-decode"] = [  # the guide's decode, --additional-config included: vLLM has no sparse offload
        *d2h_args({"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_consumer", "kv_port": free_port()}),
        "--additional-config",
        json.dumps(
            {"sparse_kv_offload_config": {"enabled": True, "topk_buffer_size": 4096, "dram_size_per_dp_GB": 128}}
        ),
    ]
    cases["good"] = ["--kv-transfer-config", vllm_decode_transfer_config(free_port())]
    out = refusals(model, cases, tmp / "in-process")

    def server(name: str, args: list[str], env: dict | None = None) -> VllmServer:
        return VllmServer(
            model, max_model_len=1024, log_path=tmp / f"{name}.log", start_timeout_s=300, env=env, extra_args=args
        )

    servers = {
        "d2h-both-role": server("d2h-both-role", d2h_args(BAD_D2H_CONFIGS["both-role"][0])),
    }
    errors = failed_starts(servers)
    return out | {name: (errors[name], servers[name].log_text()) for name in servers}


def _refused(refused: dict, case: str, message: str) -> None:
    error, log = refused[case]
    assert not error.startswith("STARTED"), error
    assert message in error or message in log, error[-3000:] + log[-3000:]


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_a_bad_store_config_stops_vllm_with_the_field_named(refused, case):
    _refused(refused, case, BAD_CONFIGS[case][2])


def test_a_metastore_that_does_not_answer_at_start_stops_vllm_with_its_address(refused, nobody):
    _refused(refused, "nobody", "MetaStore")
    assert nobody in refused["nobody"][1]


def test_a_mooncake_master_that_does_not_answer_at_start_stops_vllm_with_its_address(refused, nobody):
    _refused(refused, "nobody-mooncake", f"backend 'mooncake': no mooncake_master answers at {nobody}")


def test_the_guides_sparse_decode_config_stops_vllm_saying_where_sparse_decode_runs(refused):
    _refused(refused, "sparse-decode", "additional_config.sparse_kv_offload_config.enabled: true, but vLLM has no")
    _refused(refused, "sparse-decode", "it runs in the kvoffload decode service (kvoffload-decode")


@pytest.mark.parametrize("case", BAD_D2H_CONFIGS)
def test_a_bad_d2h_config_stops_vllm_with_the_field_named(refused, case):
    _refused(refused, f"d2h-{case}", BAD_D2H_CONFIGS[case][1])


def test_the_in_process_start_up_builds_the_engine_of_a_good_config(refused):
    error, log = refused["good"]
    assert error == "STARTED: good built its engine", error[-3000:] + log[-3000:]
    built = [line for line in log.splitlines() if "kvoffload_d2h_connector" in line]  # both roles' connectors
    assert any("role=WORKER" in line for line in built) and any("role=SCHEDULER" in line for line in built), log
