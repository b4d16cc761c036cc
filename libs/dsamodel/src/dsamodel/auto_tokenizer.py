"""``load_tokenizer``: the tokenizer a model directory holds, by what the directory holds.

An HF directory (``tokenizer.json``) gets an ``HFTokenizer``; a directory whose
``tokenizer_config.json`` names ``dsamodel.ByteTokenizer`` (the tiny presets) a ``ByteTokenizer``;
anything else is a ValueError saying what was looked for. The services call this instead of
``ByteTokenizer.from_dir``.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsamodel.hf_tokenizer import TOKENIZER_FILE, HFTokenizer
from dsamodel.tokenizer import TOKENIZER_CLASS, ByteTokenizer


def load_tokenizer(model_dir: str | Path) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of model_dir (module doc)."""
    model_dir = Path(model_dir)
    if (model_dir / TOKENIZER_FILE).is_file():
        return HFTokenizer.from_dir(model_dir)
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        try:
            cls = json.loads(config.read_text()).get("tokenizer_class")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ValueError(f"{config} is not a JSON object: {exc}") from exc
        if cls == TOKENIZER_CLASS:
            return ByteTokenizer.from_dir(model_dir)
    raise ValueError(
        f"no tokenizer in {model_dir}: expected {TOKENIZER_FILE} (an HF tokenizer) or a tokenizer_config.json "
        f"naming {TOKENIZER_CLASS!r}"
    )
