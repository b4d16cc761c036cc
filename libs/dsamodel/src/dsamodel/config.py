"""``ModelConfig``: the keys of an HF DeepSeek-V3.2 ``config.json`` that this model uses.

Built once at the edge (``ModelConfig.from_json``) and passed down; dependent sizes are properties.
Unknown keys are ignored, so a real DeepSeek-V3.2 ``config.json`` loads as is. Ignored on purpose:

- MoE (``n_routed_experts``, ``moe_intermediate_size``, ``first_k_dense_replace``, ...): every
  layer of this library uses a dense SwiGLU MLP of ``intermediate_size``.
- ``rope_scaling`` (YaRN): RoPE here is plain, with base ``rope_theta``, and the softmax scale is
  ``qk_head_dim ** -0.5`` without YaRN's mscale.
- ``quantization_config`` (fp8 blocks) and the indexer's Hadamard rotation: weights stay in
  ``torch_dtype``, indexer scores are computed in float32. ``architectures`` is kept: a
  DeepseekV32ForCausalLM's indexer cache holds fp8 keys plus float32 scales, as the serving engines
  store it (``dsamodel.indexcodec`` says how and encodes it); otherwise indexer
  keys are cached in ``torch_dtype``.

Missing required keys and bad values raise ``ValueError`` naming the key.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# Keys that must be present, all positive ints.
_REQUIRED_INTS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "vocab_size",
    "max_position_embeddings",
    "intermediate_size",
)


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The mapping of a ``config.json`` (``path`` is the file or a directory holding one); ValueError
    when it is absent, not JSON or not a JSON object. Every model config is read through here."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no model config at {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


@dataclass(frozen=True)
class ModelConfig:
    """Validated model hyper-parameters (HF DeepSeek-V3.2 key names)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    vocab_size: int
    max_position_embeddings: int
    intermediate_size: int
    q_lora_rank: int | None = None
    num_nextn_predict_layers: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    tie_word_embeddings: bool = False
    architectures: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.architectures, list):
            object.__setattr__(self, "architectures", tuple(self.architectures))
        if not isinstance(self.architectures, tuple) or not all(isinstance(a, str) for a in self.architectures):
            raise ValueError(f"architectures must be a list of strings, got {self.architectures!r}")
        for key in _REQUIRED_INTS:
            _check_int(key, getattr(self, key), minimum=1)
        if self.q_lora_rank is not None:
            _check_int("q_lora_rank", self.q_lora_rank, minimum=1)
        _check_int("num_nextn_predict_layers", self.num_nextn_predict_layers, minimum=0)
        for key in ("qk_rope_head_dim", "index_head_dim"):
            if getattr(self, key) % 2:
                raise ValueError(f"{key} must be even (RoPE rotates pairs), got {getattr(self, key)}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim "
                f"({self.qk_rope_head_dim}): the indexer applies RoPE to its first qk_rope_head_dim dims"
            )
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

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the (non-absorbed) attention: nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_width(self) -> int:
        """Elements of one main latent KV cache row: normalized c_kv ++ RoPE'd k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_cache_layers(self) -> int:
        """Layers that own a KV cache: base decoder layers, then MTP layers."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def dtype(self) -> torch.dtype:
        """``torch_dtype`` as a torch dtype."""
        return _DTYPES[self.torch_dtype]

    @property
    def softmax_scale(self) -> float:
        """Attention logit scale ``qk_head_dim ** -0.5`` (no YaRN mscale)."""
        return self.qk_head_dim**-0.5

    # ---- (de)serialization ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a ``config.json`` mapping; unknown keys are ignored."""
        if not isinstance(data, dict):
            raise ValueError(f"config must be a JSON object, got {type(data).__name__}")
        missing = [key for key in _REQUIRED_INTS if key not in data]
        if missing:
            raise ValueError(f"config is missing required key(s): {', '.join(missing)}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Read ``path`` (a ``config.json`` or a directory holding one)."""
        return cls.from_dict(read_config_json(path))

    def to_dict(self) -> dict[str, Any]:
        """The HF keys of this config (what ``from_dict`` reads back)."""
        return dataclasses.asdict(self)

    def to_json(self, path: str | Path) -> Path:
        """Write ``config.json`` deterministically (sorted keys) and return its path."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path


def _check_int(key: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {value}")
