"""The reference engine: layerwise prefill and sparse-offload decode of a DSA model through kvcore."""
