"""HFTokenizer (tokenizers + jinja2, no transformers) against transformers' AutoTokenizer on SmolLM2,
and ``load_tokenizer``'s choice by what a model directory holds."""

import pytest

from dsamodel.auto_tokenizer import load_tokenizer
from dsamodel.hf_tokenizer import HFTokenizer
from dsamodel.tokenizer import ByteTokenizer

TEXTS = (
    "Hello, world!",
    "  leading spaces\n\ttabs, ünïcödé, 日本語 and an emoji 🙂",
    "def f(x):\n    return x ** 2  # squares\n",
    "<|im_start|>user\nspecial tokens in text<|im_end|>\n",
    "",
)
CHATS = (
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Name a prime."},
    ],
)


@pytest.fixture(scope="module")
def smollm2():
    from kvoffload_testing.model_fetch import cached_model

    return cached_model("smollm2", log=lambda line: None)


@pytest.fixture(scope="module")
def hf(smollm2):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2)


def test_encode_decode_match_transformers(smollm2, hf):
    tok = HFTokenizer.from_dir(smollm2)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (len(hf), hf.bos_token_id, hf.eos_token_id)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert tok.encode(text, add_bos=True) == [tok.bos_token_id, *ids]
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    with pytest.raises(ValueError, match="outside"):
        tok.decode([tok.vocab_size])


def test_chat_template_matches_transformers(smollm2, hf):
    tok = HFTokenizer.from_dir(smollm2)
    for messages in CHATS:
        text = tok.apply_chat_template(messages)
        assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n")
        hf_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        assert tok.encode(text) == hf_ids["input_ids"]
    assert tok.apply_chat_template(CHATS[0], add_generation_prompt=False) == hf.apply_chat_template(
        CHATS[0], tokenize=False, add_generation_prompt=False
    )
    with pytest.raises(ValueError, match="message 0"):
        tok.apply_chat_template([{"role": "user"}])


def test_load_tokenizer_picks_by_directory(smollm2, tmp_path):
    assert isinstance(load_tokenizer(smollm2), HFTokenizer)
    ByteTokenizer().save(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer(tmp_path / "missing")
