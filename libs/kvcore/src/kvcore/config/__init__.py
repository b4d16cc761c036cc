"""kvcore.config: the JSON users write (``--kv-transfer-config``, ``--additional-config``), checked and
typed, and the validated settings of a node.

- ``parse``: the parse entry points (``parse_kv_transfer_config``, ``parse_additional_config``).
- ``kv_transfer``: ``KVTransferConfig`` and ``MultiConnectorConfig`` (``--kv-transfer-config``).
- ``connectors``: each connector's extra config (``StoreConnectorConfig``, ``D2HConnectorConfig``).
- ``pool_keys``: each host-pool backend's keys in the store connector's extra config (typed models).
- ``additional``: ``AdditionalConfig`` and its ``SparseKVOffloadConfig``.
- ``names``: the names the JSON accepts (connectors, roles, backends, policies, keys).
- ``errors``: ``ConfigError`` and the friendly messages of config problems.
- ``fields``: the strict field rules of the config models.
- ``model``: ``ConfigModel``, their base (unknown keys as warnings, every problem at once).
- ``node``: a node's two JSON options parsed together, and its connectors looked up in them.
- ``prefill_settings`` / ``decode_settings``: the validated settings of a prefill / decode node.
- ``mmc_files``: the Memcache conf files (``mmc-meta.conf`` / ``mmc-local.conf``).
"""
