"""``LlamaConfig``: the keys of an HF Llama ``config.json`` this library uses, validated once.

Built at the edge (``LlamaConfig.from_json``) and passed down; dependent sizes are properties named
as ``ModelConfig``'s are, so an engine reads either config the same way (``kv_row_width``,
``num_cache_layers``, ``num_nextn_predict_layers``, ``softmax_scale``, ``dtype``, ``index_head_dim``,
``index_topk``). Unknown keys are ignored. Refused (``ValueError`` naming the key): a ``model_type``
other than ``llama``, RoPE scaling of any ``rope_type`` but ``default``, a ``hidden_act`` other
than ``silu``, attention or MLP biases, query heads not a multiple of the KV heads, an
``eos_token_id`` list of more than one id (the samplers stop at one).

The indexer fields (``index_rank``, ``index_topk``) are not HF keys: ``dsamodel.pca_indexer``'s
``kvoffload-indexer/kvoffload-indexer.json`` beside the weights sets them when the model has a PCA indexer
(``dataclasses.replace``); without one they are None and ``has_indexer`` is False.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from dsamodel.config import read_config_json

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
MODEL_TYPE = "llama"

_REQUIRED_INTS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class LlamaConfig:
    """Validated Llama hyper-parameters (HF key names) plus the optional PCA indexer's size."""

    model_type: ClassVar[str] = MODEL_TYPE

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    tie_word_embeddings: bool = False
    architectures: tuple[str, ...] = ()
    index_rank: int | None = None  # PCA indexer: principal directions kept per KV head
    index_topk: int | None = None  # PCA indexer: the default number of tokens selected per query

    def __post_init__(self) -> None:
        if isinstance(self.architectures, list):
            object.__setattr__(self, "architectures", tuple(self.architectures))
        if not isinstance(self.architectures, tuple) or not all(isinstance(a, str) for a in self.architectures):
            raise ValueError(f"architectures must be a list of strings, got {self.architectures!r}")
        for key in (*_REQUIRED_INTS, "num_key_value_heads", "head_dim"):
            _check_int(key, getattr(self, key), minimum=1)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        for key in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{key} must be a number > 0, got {value!r}")
        if self.torch_dtype not in _DTYPES:
            raise ValueError(f"torch_dtype must be one of {sorted(_DTYPES)}, got {self.torch_dtype!r}")
        for key in ("bos_token_id", "eos_token_id"):
            value = getattr(self, key)
            if value is not None:
                _check_int(key, value, minimum=0)
                if value >= self.vocab_size:
                    raise ValueError(f"{key} ({value}) must be < vocab_size ({self.vocab_size})")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be true/false, got {self.tie_word_embeddings!r}")
        self._check_indexer()

    def _check_indexer(self) -> None:
        if (self.index_rank is None) != (self.index_topk is None):
            raise ValueError("index_rank and index_topk are set together (the indexer's) or not at all")
        if self.index_rank is not None and self.index_topk is not None:
            _check_int("index_rank", self.index_rank, minimum=1)
            _check_int("index_topk", self.index_topk, minimum=1)
            if self.index_rank > self.head_dim:
                raise ValueError(f"index_rank ({self.index_rank}) must be <= head_dim ({self.head_dim})")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def kv_row_width(self) -> int:
        """Elements of one KV cache row: RoPE'd K of every KV head, then V of every KV head."""
        return 2 * self.num_key_value_heads * self.head_dim

    @property
    def num_cache_layers(self) -> int:
        """Layers that own a KV cache: every decoder layer (Llama has no MTP layers)."""
        return self.num_hidden_layers

    @property
    def num_nextn_predict_layers(self) -> int:
        return 0

    @property
    def num_query_groups(self) -> int:
        """Query heads sharing one KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.torch_dtype]

    @property
    def has_indexer(self) -> bool:
        return self.index_rank is not None

    @property
    def index_head_dim(self) -> int | None:
        """Elements of one indexer key: ``index_rank`` per KV head (None without an indexer)."""
        return None if self.index_rank is None else self.num_key_value_heads * self.index_rank

    # ---- (de)serialization ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LlamaConfig:
        """Build from an HF Llama ``config.json`` mapping; unknown keys are ignored."""
        if not isinstance(data, dict):
            raise ValueError(f"config must be a JSON object, got {type(data).__name__}")
        if data.get("model_type") != MODEL_TYPE:
            raise ValueError(f"model_type must be {MODEL_TYPE!r}, got {data.get('model_type')!r}")
        missing = [key for key in _REQUIRED_INTS if key not in data]
        if missing:
            raise ValueError(f"config is missing required key(s): {', '.join(missing)}")
        _check_unsupported(data)
        values = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        values["num_key_value_heads"] = data.get("num_key_value_heads", data["num_attention_heads"])
        if "head_dim" not in data:
            values["head_dim"] = _default_head_dim(data)
        values["rope_theta"] = _rope_theta(data)
        dtype = data.get("torch_dtype") or data.get("dtype")  # transformers 5 writes "dtype"
        if dtype is not None:
            values["torch_dtype"] = dtype
        eos = data.get("eos_token_id")
        if isinstance(eos, list):
            if len(set(eos)) > 1:
                raise ValueError(f"eos_token_id lists {eos}: this library's samplers stop at one EOS id")
            values["eos_token_id"] = eos[0] if eos else None
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | Path) -> LlamaConfig:
        """Read ``path`` (a ``config.json`` or a directory holding one)."""
        return cls.from_dict(read_config_json(path))


def _check_unsupported(data: dict[str, Any]) -> None:
    if data.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act must be 'silu' (SwiGLU MLP), got {data['hidden_act']!r}")
    for key in ("attention_bias", "mlp_bias"):
        if data.get(key, False):
            raise ValueError(f"{key} must be false: this Llama has bias-free projections")
    if data.get("rope_scaling") not in (None, {}) and _rope_type(data.get("rope_scaling")) != "default":
        raise ValueError(f"rope_scaling {data['rope_scaling']!r} is not supported: only plain RoPE (rope_theta)")
    params = data.get("rope_parameters")
    if params is not None and _rope_type(params) != "default":
        raise ValueError(f"rope_parameters {params!r} is not supported: only rope_type 'default'")


def _rope_type(params: Any) -> Any:
    if not isinstance(params, dict):
        return params
    return params.get("rope_type", params.get("type", "default"))


def _rope_theta(data: dict[str, Any]) -> Any:
    params = data.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return params["rope_theta"]
    return data.get("rope_theta", 10000.0)


def _default_head_dim(data: dict[str, Any]) -> int:
    hidden, heads = data["hidden_size"], data["num_attention_heads"]
    _check_int("hidden_size", hidden, minimum=1)
    _check_int("num_attention_heads", heads, minimum=1)
    if hidden % heads:
        raise ValueError(f"head_dim is absent and hidden_size ({hidden}) is not a multiple of num_attention_heads")
    return hidden // heads


def _check_int(key: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {value}")
