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
- ``dense_reference``  whole-sequence paths: ``forward_dense`` (absorbed, sparse, gathered: the
                 no-offload reference) and ``forward_naive`` (per-head K/V, boolean mask).
- ``dense_decode`` ``generate_full_kv``: ``generate_dense``'s tokens incrementally, over a full KV
                 per layer (no blocks, buffers, pools or hot cache): the stacks' test oracle.
- ``weights``    HF-named safetensors load/save (``checkpoint``: reading and checking a checkpoint);
                 ``tokenizer`` byte tokenizer; ``sampling``
                 greedy and seeded top-p (``RequestSampler``, over ``openai_api``'s ``SamplingParams``);
                 ``presets`` the tiny seeded test model.
- ``indexcodec`` how indexer keys are stored in caches (``indexer_cache_format``: the format a config's
                 serving engine uses; ``IndexCodec``: plain or fp8 + scales).
- ``tp``         tensor parallelism: one rank's shard of the weights and the reductions it needs
                 (DSA only: a Llama model is refused for TP > 1).

A Llama-architecture model (GQA, RoPE, SwiGLU; e.g. SmolLM2) with the same per-layer split, and the
training-free PCA indexer that lets it run sparse attention:

- ``llama_config``  ``LlamaConfig``: an HF Llama ``config.json``, validated (sizes named as ``ModelConfig``'s).
- ``llama_rope``    Llama's rotate-half RoPE, computed as transformers does.
- ``gqa``           ``gqa_attention`` (each query over its gathered K/V rows) and ``gqa_causal_attention``
                    (a prefill chunk over the request's rows, memory-bounded).
- ``llama``         ``LlamaModel`` / ``LlamaLayer``: ``project`` -> ``attend`` / ``attend_causal`` (and
                    ``select`` / ``select_batched`` with an indexer) -> ``finish``.
- ``llama_weights`` loading a Llama directory (HF names) and its indexer; ``weights.load_model`` dispatches
                    on ``model_type``.
- ``llama_reference`` whole-sequence Llama paths: ``forward_llama_dense``, ``forward_llama_sparse``,
                    ``generate_llama_dense``.
- ``pca_indexer``   the PCA indexer (Loki): per-head bases, ``pca_select`` / ``pca_select_batched`` (the
                    engine's top-k conventions), its files beside the weights.
- ``indexer_corpus`` the installed files it is calibrated on, and held-out ones.
- ``indexer_build`` ``build_indexer``: calibrate the bases (one eigh per layer and head) and write them.
- ``indexer_recall`` ``attention_recall``: share of the dense attention mass the indexer's top-k keeps,
                    beside the exact top-k (ceiling) and a recency window (floor).
- ``hf_tokenizer``  ``HFTokenizer``: ``tokenizer.json`` + the chat template (tokenizers + jinja2, no
                    transformers); ``auto_tokenizer`` ``load_tokenizer``: Byte or HF by the directory.
- ``served``        ``ServedModel`` (either model) and ``sparse_ready``: the start-up check that a model
                    can select tokens for sparse decode (a Llama model needs its indexer built).

The model owns no cache: an engine keeps the latent KV rows (``Projection.kv``) and indexer rows
(``Projection.index_k``) wherever it likes and hands them back in, gpt-fast style: the offload
engine that does so over kvcore is ``kvoffload_engine``. The model's modules import neither (its
engine benchmarks are ``kvoffload_bench``'s).
"""

from dsamodel.attention import gather_rows, indexer_topk, sparse_mla_attention
from dsamodel.auto_tokenizer import load_tokenizer
from dsamodel.config import ModelConfig
from dsamodel.dense_reference import forward_dense, forward_dense_mtp, forward_naive, generate_dense
from dsamodel.hf_tokenizer import HFTokenizer
from dsamodel.llama import LlamaLayer, LlamaModel, LlamaProjection
from dsamodel.llama_config import LlamaConfig
from dsamodel.llama_reference import forward_llama_dense, forward_llama_sparse
from dsamodel.model import DecoderLayer, DSAModel, MTPLayer, Projection
from dsamodel.sampling import RequestSampler, greedy
from dsamodel.tokenizer import ByteTokenizer
from dsamodel.weights import load_model, load_weights, save_model, save_weights

__version__ = "0.1.0"

__all__ = [
    "ByteTokenizer",
    "DSAModel",
    "DecoderLayer",
    "HFTokenizer",
    "LlamaConfig",
    "LlamaLayer",
    "LlamaModel",
    "LlamaProjection",
    "MTPLayer",
    "ModelConfig",
    "Projection",
    "RequestSampler",
    "forward_dense",
    "forward_dense_mtp",
    "forward_llama_dense",
    "forward_llama_sparse",
    "forward_naive",
    "gather_rows",
    "generate_dense",
    "greedy",
    "indexer_topk",
    "load_model",
    "load_tokenizer",
    "load_weights",
    "save_model",
    "save_weights",
    "sparse_mla_attention",
]
