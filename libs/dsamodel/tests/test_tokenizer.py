"""Byte tokenizer: round trips, specials, invalid UTF-8, chat template, config file."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsamodel.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


@given(st.text())
def test_round_trip(text):
    ids = TOK.encode(text)
    assert all(0 <= i < TOK.vocab_size for i in ids)
    assert TOK.decode(ids) == text


def test_bytes_and_specials():
    assert TOK.vocab_size == 264
    assert TOK.encode("A\u00e9") == [65, 0xC3, 0xA9]
    assert TOK.encode("hi", add_bos=True) == [256, 104, 105]
    ids = TOK.encode("a<|eos|>b<|user|>")
    assert ids == [97, TOK.eos_token_id, 98, 260]
    assert TOK.decode(ids) == "a<|eos|>b<|user|>"
    assert TOK.decode(ids, skip_special_tokens=True) == "ab"
    assert TOK.decode([0xC3]) == "\ufffd"  # a truncated UTF-8 sequence is replaced
    with pytest.raises(ValueError, match="outside"):
        TOK.decode([264])
    with pytest.raises(ValueError, match="str"):
        TOK.encode(b"bytes")


def test_chat_template():
    text = TOK.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert text == "<|bos|><|system|>be brief<|eos|><|user|>hi<|eos|><|assistant|>"
    ids = TOK.encode(text)
    assert ids[0] == TOK.bos_token_id and ids[-1] == 261
    assert not TOK.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False).endswith(
        "<|assistant|>"
    )
    with pytest.raises(ValueError, match="message 0"):
        TOK.apply_chat_template([{"role": "robot", "content": "x"}])


def test_config_file(tmp_path):
    TOK.save(tmp_path)
    assert ByteTokenizer.from_dir(tmp_path).special_ids == TOK.special_ids
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    with pytest.raises(ValueError, match="LlamaTokenizer"):
        ByteTokenizer.from_dir(tmp_path)
