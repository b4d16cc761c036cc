"""Every key of the feature guide, as a vLLM server with the kvoffload connectors reads it: honoured
(its value reaches the connector's typed settings), or named in a warning or an error at start-up;
never silently unread.

The checks run the connectors' own start-up config readers (``store_config``, ``d2h_settings``) on
a real ``VllmConfig`` of a tiny Llama (vLLM's ``EngineArgs``), each guide key set the way the guide
writes it, on top of a config that is good without it. The whole servers' refusals are
``test_vllm_refusals.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from structlog.testing import capture_logs
from vllm_support import tiny_llama_dir

from kvcore.config.errors import ConfigError

MODULE = {"kv_connector_module_path": "kvoffload_vllm"}
STORE = {"backend": "kvoffload", "metastore": "127.0.0.1:5000"}  # good without any guide key
SPARSE = {"enabled": True, "topk_buffer_size": 4096, "dram_size_per_dp_GB": 128}  # the guide's decode


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    from vllm.engine.arg_utils import EngineArgs

    model = tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "llama")
    return EngineArgs(model=str(model), max_model_len=1024, enforce_eager=True).create_engine_config()


def store(role: str = "kv_producer", **extra: Any) -> dict:
    return {
        "kv_connector": "AscendStoreConnector",
        "kv_role": role,
        **MODULE,
        "kv_connector_extra_config": STORE | extra,
    }


def d2h(role: str, kv_port: int | None = None, **extra: Any) -> dict:
    port = {"kv_port": kv_port} if kv_port is not None else {}
    return {
        "kv_connector": "SfaRemoteD2HConnector",
        "kv_role": role,
        **port,
        **MODULE,
        "kv_connector_extra_config": extra,
    }


def read(vllm_config, kv: dict, additional: dict | None = None):
    """The connector's start-up reading of ``kv`` (with ``--additional-config`` ``additional``): its
    typed settings, and the warnings it logged."""
    from vllm.config import KVTransferConfig

    from kvoffload_vllm.d2h_settings import d2h_settings
    from kvoffload_vllm.store_config import store_config

    vllm_config.kv_transfer_config = KVTransferConfig(**kv)
    vllm_config.additional_config = additional or {}
    reader = store_config if kv["kv_connector"] == "AscendStoreConnector" else d2h_settings
    with capture_logs() as logs:
        settings = reader(vllm_config)
    return settings, [e for e in logs if e["log_level"] == "warning"]


def honoured(check: Callable[[Any], bool]):
    return ("honoured", check)


def warned(words: str):
    return ("warned", words)


def refused(words: str):
    return ("refused", words)


# key (as the guide writes it) -> (the config that sets it, what the server does with it)
GUIDE_KEYS: dict[str, tuple[tuple[dict, dict | None], tuple[str, Any]]] = {
    # the prefill's AscendStoreConnector
    "store.backend=memcache": (
        (store(backend="memcache"), None),
        refused("kv_connector_extra_config.backend: got 'memcache'"),
    ),
    "store.use_layerwise+layerwise_num_shared_buffers+layerwise_independent_layers": (
        (store(use_layerwise=True, layerwise_num_shared_buffers=3, layerwise_independent_layers=[0]), None),
        honoured(
            lambda s: (
                (s.use_layerwise, s.layerwise_num_shared_buffers, s.layerwise_independent_layers) == (True, 3, (0,))
            )
        ),
    ),
    "store.layerwise_num_shared_buffers without use_layerwise": (
        (store(layerwise_num_shared_buffers=3), None),
        warned("layerwise_num_shared_buffers"),
    ),
    # the prefill's SfaRemoteD2HConnector
    "prefill d2h.kv_port": ((d2h("kv_producer", 20050), None), warned("kv_transfer_config.kv_port")),
    "prefill d2h.transfer_backend=memfabric": (
        (d2h("kv_producer", transfer_backend="memfabric"), None),
        refused("transfer_backend: got 'memfabric'"),
    ),
    # the decode
    "decode d2h.kv_port": ((d2h("kv_consumer", 20050), None), honoured(lambda s: s.control_port == 20050)),
    "decode d2h.transfer_backend=memfabric": (
        (d2h("kv_consumer", 20050, transfer_backend="memfabric"), None),
        refused("transfer_backend: got 'memfabric'"),
    ),
    "decode d2h.use_layerwise=true": (
        (d2h("kv_consumer", 20050, use_layerwise=True), None),
        honoured(lambda s: s.role == "kv_consumer"),  # the pull is layerwise: nothing to warn about
    ),
    "decode d2h.use_layerwise=false": (
        (d2h("kv_consumer", 20050, use_layerwise=False), None),
        warned("kv_connector_extra_config.use_layerwise"),
    ),
    "sparse_kv_offload_config (enabled, topk_buffer_size, dram_size_per_dp_GB)": (
        (d2h("kv_consumer", 20050), {"sparse_kv_offload_config": SPARSE}),
        refused("additional_config.sparse_kv_offload_config.enabled: true, but vLLM has no sparse KV offload"),
    ),
    "sparse_kv_offload_config.keep_device_kv_cache, not enabled": (
        (d2h("kv_consumer", 20050), {"sparse_kv_offload_config": {"enabled": False, "keep_device_kv_cache": False}}),
        warned("additional_config.sparse_kv_offload_config"),
    ),
    "sparse_kv_offload_config on the prefill's store": (
        (store(), {"sparse_kv_offload_config": SPARSE}),
        refused("additional_config.sparse_kv_offload_config.enabled"),
    ),
}


@pytest.mark.parametrize("key", GUIDE_KEYS)
def test_every_guide_key_is_honoured_or_named_in_a_warning_or_an_error(vllm_config, key):
    (kv, additional), (outcome, expect) = GUIDE_KEYS[key]
    if outcome == "refused":
        with pytest.raises(ConfigError) as error:
            read(vllm_config, kv, additional)
        assert expect in str(error.value), str(error.value)
        return
    settings, warnings = read(vllm_config, kv, additional)
    if outcome == "warned":
        assert any(expect in key for w in warnings for key in w.get("keys", ())), warnings
    else:
        assert expect(settings), settings
        assert not warnings, warnings  # honoured: nothing said to be ignored


def test_the_guides_mmc_variables_are_read_by_the_store_and_named_by_the_d2h(vllm_config, tmp_path, monkeypatch):
    """``MMC_META_CONFIG_PATH`` / ``MMC_LOCAL_CONFIG_PATH``, exported as the guide does: the store takes
    the MetaService and pool size its config leaves out, the pair rules refuse a mismatch, and the D2H
    connector (no pool) names the variables it does not read."""
    meta, local = tmp_path / "mmc-meta.conf", tmp_path / "mmc-local.conf"
    meta.write_text(
        "ock.mmc.meta_service_url = tcp://127.0.0.1:5000\nock.mmc.meta_service.config_store_url = tcp://127.0.0.1:6000\n"
    )
    local.write_text(
        "ock.mmc.meta_service_url = tcp://127.0.0.1:5000\nock.mmc.local_service.config_store_url = tcp://127.0.0.1:6000\n"
        "ock.mmc.local_service.protocol = device_sdma\nock.mmc.local_service.dram.size = 2GB\n"
    )
    monkeypatch.setenv("MMC_META_CONFIG_PATH", str(meta))
    monkeypatch.setenv("MMC_LOCAL_CONFIG_PATH", str(local))
    bare = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_producer", **MODULE}
    settings, warnings = read(vllm_config, {**bare, "kv_connector_extra_config": {"backend": "kvoffload"}})
    assert (settings.metastore, settings.host_pool_gb) == ("127.0.0.1:5000", 2.0) and not warnings, warnings
    _, warnings = read(vllm_config, d2h("kv_consumer", 20050))
    assert any(f"$MMC_LOCAL_CONFIG_PATH={local}" in k for w in warnings for k in w.get("keys", ())), warnings
    local.write_text(
        "ock.mmc.meta_service_url = tcp://127.0.0.1:5000\nock.mmc.local_service.config_store_url = tcp://127.0.0.1:6001\n"
    )
    with pytest.raises(ConfigError, match="the LocalService's config store must be the MetaService's"):
        read(vllm_config, store())


def test_backend_mooncake_takes_its_master_and_no_metastore(vllm_config, tmp_path, monkeypatch):
    """``backend: "mooncake"``: the mooncake_master as the reference prefill takes it (required), no
    metastore (refused, naming the key); the mmc-local.conf's pool size still applies, its MetaService
    is not taken (the embedded pool's only)."""
    bare = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_producer", **MODULE}

    def mooncake(**extra: Any) -> dict:
        return {**bare, "kv_connector_extra_config": {"backend": "mooncake", **extra}}

    settings, warnings = read(vllm_config, mooncake(mooncake_master="127.0.0.1:50051", use_layerwise=True))
    assert (settings.backend, settings.mooncake_master, settings.metastore) == ("mooncake", "127.0.0.1:50051", None)
    assert not warnings, warnings
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.mooncake_master: required with backend"):
        read(vllm_config, mooncake())
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.metastore: applies to backend 'kvoffload'"):
        read(vllm_config, mooncake(mooncake_master="127.0.0.1:50051", metastore="127.0.0.1:5000"))
    local = tmp_path / "mmc-local.conf"
    local.write_text("ock.mmc.meta_service_url = tcp://127.0.0.1:5000\nock.mmc.local_service.dram.size = 2GB\n")
    monkeypatch.setenv("MMC_LOCAL_CONFIG_PATH", str(local))
    settings, _ = read(vllm_config, mooncake(mooncake_master="127.0.0.1:50051"))
    assert (settings.metastore, settings.host_pool_gb) == (None, 2.0)
