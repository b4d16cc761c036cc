"""--metastore / --host-pool-gb and the store config's metastore / host_pool_gb: either one, the
flag's default when neither, an error naming both when they disagree."""

from __future__ import annotations

import argparse

import pytest
from kvcore.config import ConfigError, StoreConnectorConfig

from kvoffload_prefill.server import _pool_flags


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"metastore": None, "host_pool_gb": None, **kw})


def test_neither_gives_no_metastore_and_one_gib():
    args = _args()
    _pool_flags(args, StoreConnectorConfig(backend="kvoffload"))
    assert (args.metastore, args.host_pool_gb) == (None, 1.0)


def test_the_config_fills_what_the_flags_leave_out():
    args = _args(host_pool_gb=0.5)
    _pool_flags(args, StoreConnectorConfig(backend="kvoffload", metastore="10.0.0.1:5000", host_pool_gb=0.5))
    assert (args.metastore, args.host_pool_gb) == ("10.0.0.1:5000", 0.5)


def test_a_flag_and_a_config_key_that_disagree_name_both():
    with pytest.raises(ConfigError) as e:
        _pool_flags(_args(metastore="a:1"), StoreConnectorConfig(backend="kvoffload", metastore="b:2"))
    assert "--metastore a:1" in str(e.value) and "kv_connector_extra_config.metastore 'b:2'" in str(e.value)
