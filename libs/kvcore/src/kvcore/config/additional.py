"""``--additional-config``: ``AdditionalConfig`` and its ``sparse_kv_offload_config`` section
(``SparseKVOffloadConfig``: decode-side sparse offload, the hot cache's policy, miss prefetch).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, ClassVar

from pydantic import BeforeValidator, ConfigDict, Field

from kvcore.config.errors import Loc
from kvcore.config.fields import StrictBool, choice, dram_gib, int_rule
from kvcore.config.model import ConfigModel
from kvcore.config.names import DEFAULT_HOT_CACHE_POLICY, HOT_CACHE_POLICIES, SPARSE_KEY


class SparseKVOffloadConfig(ConfigModel):
    """``sparse_kv_offload_config`` of ``--additional-config`` (decode-side sparse offload)."""

    _ROOT: ClassVar[str] = SPARSE_KEY

    enabled: StrictBool = False
    topk_buffer_size: Annotated[int, int_rule(1)] = 4096
    dram_size_per_dp_GB: Annotated[int, BeforeValidator(dram_gib)] = 128
    keep_device_kv_cache: StrictBool = False
    # kvoffload's own key: the hot cache's replacement policy (kvcore.hotcache.POLICIES)
    hot_cache_policy: Annotated[str, choice(HOT_CACHE_POLICIES)] = DEFAULT_HOT_CACHE_POLICY
    # kvoffload's own key: load the next layer's predicted misses while a layer runs
    miss_prefetch: StrictBool = False

    @property
    def dram_bytes_per_dp(self) -> int:
        """Host pool bytes per DP rank (``dram_size_per_dp_GB`` GiB)."""
        return self.dram_size_per_dp_GB * 2**30


class AdditionalConfig(ConfigModel):
    """``--additional-config``: this feature's ``sparse_kv_offload_config``; other keys belong to
    other features and are kept (``model_extra``) without warnings unless they look like a typo."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)
    _ROOT: ClassVar[str] = "additional_config"

    sparse_kv_offload_config: SparseKVOffloadConfig = Field(default_factory=SparseKVOffloadConfig)

    @classmethod
    def _unknown_key_warnings(cls, data: Mapping[Any, Any]) -> list[str]:
        return [
            f"unknown key {key!r} (ignored); did you mean {SPARSE_KEY!r}?"
            for key in data
            if isinstance(key, str)
            and key != SPARSE_KEY
            and difflib.SequenceMatcher(None, key, SPARSE_KEY).ratio() >= 0.8
        ]

    def _children(self) -> Iterable[tuple[Loc, ConfigModel]]:
        return (((SPARSE_KEY,), self.sparse_kv_offload_config),)

    @property
    def sparse(self) -> SparseKVOffloadConfig:
        return self.sparse_kv_offload_config
