"""dsamodel: the reference DeepSeek-V3.2-style sparse-attention (DSA) model in plain torch.

One concept per module:

- ``config``     ``ModelConfig``: the HF ``config.json`` keys this model uses, validated once.
- ``rope``       rotary position embedding (interleaved for MLA, rotate-half for the indexer).
- ``modules``    RMSNorm and the dense SwiGLU MLP.
- ``mla``        the per-layer projections: MLA (compressed latent KV) and the lightning indexer.
- ``attention``  pure functions an engine calls between projections: ``indexer_topk``,
                 ``gather_rows``, ``sparse_mla_attention``.
- ``model``      ``DSAModel`` / ``DecoderLayer`` / ``MTPLayer`` with the per-layer steps
                 ``project`` -> (engine caches rows, selects, gathers) -> ``finish``.
- ``reference``  whole-sequence paths: ``forward_dense`` (absorbed, sparse, gathered: the
                 no-offload reference) and ``forward_naive`` (per-head K/V, boolean mask).
- ``dense_decode`` ``generate_full_kv``: ``generate_dense``'s tokens incrementally, over a full KV
                 per layer (no blocks, buffers, pools or hot cache): the stacks' test oracle.
- ``weights``    HF-named safetensors load/save; ``tokenizer`` byte tokenizer; ``sampling``
                 greedy and seeded top-p (``RequestSampler``, over ``openai_api``'s ``SamplingParams``);
                 ``presets`` the tiny seeded test model.
- ``indexcodec`` how indexer keys are stored in caches (``indexer_cache_format``: the format a config's
                 serving engine uses; ``IndexCodec``: plain or fp8 + scales).
- ``tp``         tensor parallelism: one rank's shard of the weights and the reductions it needs.

The model owns no cache: an engine keeps the latent KV rows (``Projection.kv``) and indexer rows
(``Projection.index_k``) wherever it likes and hands them back in, gpt-fast style: the offload
engine that does so over kvcore is ``kvoffload_engine``. The model's modules import neither (its
engine benchmarks are ``kvoffload_bench``'s).
"""

from dsamodel.attention import gather_rows, indexer_topk, sparse_mla_attention
from dsamodel.config import ModelConfig
from dsamodel.model import DecoderLayer, DSAModel, MTPLayer, Projection
from dsamodel.reference import forward_dense, forward_dense_mtp, forward_naive, generate_dense
from dsamodel.sampling import RequestSampler, greedy
from dsamodel.tokenizer import ByteTokenizer
from dsamodel.weights import load_model, load_weights, save_model, save_weights

__version__ = "0.1.0"

__all__ = [
    "ByteTokenizer",
    "DSAModel",
    "DecoderLayer",
    "MTPLayer",
    "ModelConfig",
    "Projection",
    "RequestSampler",
    "forward_dense",
    "forward_dense_mtp",
    "forward_naive",
    "gather_rows",
    "generate_dense",
    "greedy",
    "indexer_topk",
    "load_model",
    "load_weights",
    "save_model",
    "save_weights",
    "sparse_mla_attention",
]
