"""The ``AscendStoreConnector``'s counters: name -> what it counts (vLLM stats and Prometheus help)."""

COUNTERS = {
    "blocks_saved": "blocks (of all layers) written to the host pool",
    "bytes_saved": "bytes written to the host pool",
    "blocks_loaded": "blocks (of all layers) loaded from the host pool into vLLM's cache",
    "bytes_loaded": "bytes loaded from the host pool",
    "save_errors": "blocks whose save failed or was skipped (pool full, its index down: metastore, mooncake_master)",
    "load_errors": "blocks whose load failed (vLLM recomputed them)",
    "lookups": "prefix lookups in the pool's index (metastore, mooncake_master)",
    "hit_tokens": "prompt tokens found in the host pool",
    "layers_saved_during_forward": "layers in the pool before the last layer's attention of their step ended",
}
