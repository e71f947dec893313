"""Tokenizers from GGUF metadata and from a tokenizer.json directory agree; chat templates render safely."""

from __future__ import annotations

import json

import pytest

from conveyor.model.tokenizer import ChatTemplateError, Tokenizer


def test_tokenizer_json_directory_gives_the_same_tokens_and_template(tokenizer, tmp_path):
    tokenizer.hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": tokenizer.chat_template, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"})
    )
    from_dir = Tokenizer.load(tmp_path)
    text = "Numbers 12345, accents é, and <|im_end|> specials."
    assert from_dir.encode(text) == tokenizer.encode(text)
    assert from_dir.eos_token_ids == tokenizer.eos_token_ids
    chat = [{"role": "user", "content": "hi"}]
    assert from_dir.encode_chat(chat) == tokenizer.encode_chat(chat)


def test_text_parts_are_joined_and_bad_messages_are_refused(tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    assert tokenizer.apply_chat_template(parts) == tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\] must be an object with a string 'role'"):
        tokenizer.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ChatTemplateError, match="only text parts"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_templates_run_sandboxed(tokenizer):
    evil = Tokenizer(tokenizer.hf, {"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"})
    with pytest.raises(ChatTemplateError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])
