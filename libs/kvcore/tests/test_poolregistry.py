"""The host-pool registry: one entry per backend, whose names are the config's choices, whose keys
models make up the store connector's keys, and whose hooks are imported only when used (they are
run by ``poolbackends.registry``, tested there)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcore.config.connectors import StoreCommonKeys, StoreConnectorConfig
from kvcore.pool import registry as poolregistry
from kvcore.pool.registry import (
    EMBEDDED,
    POOL_BACKENDS,
    STACK_POOLS,
    STORE_BACKENDS,
    VLLM_POOLS,
    key_models,
    load,
)


def test_the_names_are_the_config_choices_and_the_embedded_backend_runs_everywhere() -> None:
    assert STORE_BACKENDS == ("kvoffload", "memcache", "mooncake")
    assert STACK_POOLS == ("kvoffload", "mooncake") and VLLM_POOLS == ("kvoffload", "mooncake")
    embedded = POOL_BACKENDS[EMBEDDED]
    assert embedded.probe is None and not embedded.index and not embedded.local_config
    assert all(name == b.name for name, b in POOL_BACKENDS.items())


def test_the_store_config_holds_the_common_keys_then_each_backends_own() -> None:
    fields = list(StoreConnectorConfig.model_fields)
    backend_keys = [key for model in key_models().values() for key in model.model_fields]
    assert fields == [*StoreCommonKeys.model_fields, *backend_keys]
    assert len(set(fields)) == len(fields)  # no key belongs to two backends


def test_each_entry_speaks_of_keys_that_exist() -> None:
    """Required keys are the backend's own; tolerated keys are another backend's; every backend key
    says what it is for (the refusal message quotes it)."""
    models = key_models()
    for backend in POOL_BACKENDS.values():
        own = set(models[backend.name].model_fields) if backend.name in models else set()
        others = {key for name, model in models.items() if name != backend.name for key in model.model_fields}
        assert set(backend.required) <= own, backend.name
        assert backend.tolerates <= others, backend.name
    assert all(spec.description for model in models.values() for spec in model.model_fields.values())


def test_the_vllm_store_looks_up_in_a_server_a_key_names_or_says_why_it_cannot() -> None:
    """A backend the vLLM store runs has a lookup and names the key of the server it asks (a key of its
    own, or the embedded one's metastore); the others say why vLLM refuses them."""
    fields = StoreConnectorConfig.model_fields
    for backend in POOL_BACKENDS.values():
        if backend.lookup:
            assert backend.lookup_server in fields and not backend.vllm_refusal, backend.name
        else:
            assert backend.vllm_refusal and not backend.lookup_server, backend.name
    assert POOL_BACKENDS["mooncake"].lookup_server == "mooncake_master" in POOL_BACKENDS["mooncake"].required


def test_load_resolves_module_and_attribute_paths() -> None:
    assert load("kvcore.pool.registry:PoolBackend") is poolregistry.PoolBackend
    assert load("kvcore.pool.registry:POOL_BACKENDS.get") == POOL_BACKENDS.get
    with pytest.raises(ModuleNotFoundError):
        load("kvcore.no_such_module:thing")


def test_reading_the_registry_imports_no_backend_and_no_pydantic() -> None:
    """The command line reads the names (``--pool`` choices) without paying for a backend or the config models."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, kvcore.pool.registry as r; r.STACK_POOLS; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('pydantic', 'torch', 'poolbackends', 'mooncake', 'memcache_hybrid')))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]"
