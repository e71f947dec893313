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


MULTILINGUAL = (
    "Hello world! It's 2026; we'll ship v1.2.3 at 09:45 — naïve café, Straße, 12345678 items.\n"
    "中文分词测试：今天天气很好。日本語のテキストも混ぜます。한국어 문장도 있습니다. "
    "Привет, как дела? مرحبا بالعالم. नमस्ते दुनिया\n"
    "def f(x):\n\treturn {'a': [1, 22, 333, 4444]}  # code    with   spaces\r\n"
    "emoji: 👍🏽 🚀✨ 👨‍👩‍👧 and ZWJ, tabs\t\tand trailing spaces   "
)


@pytest.mark.parametrize("pre, arch", [("llama-bpe", "llama"), ("qwen2", "qwen2")])
def test_gguf_byte_level_tokenizers_match_transformers(tmp_path, pre, arch):
    """A byte-level BPE vocabulary written as GGUF with llama.cpp's llama3 or qwen2 pre-tokenizer: Conveyor's
    tokenizer and the one transformers builds from the same file split a multilingual text with digits, code
    and emoji into the same ids, and decode them back to the text."""
    import gguf
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    from conveyor.model.tokenizer import tokenizer_from_gguf

    trained = HFTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|begin|>", "<|end|>"])
    trained.train_from_iterator([MULTILINGUAL * 3, "the quick brown fox 0123456789 " * 20], trainer)
    vocab = trained.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [f"{a} {b}" for a, b in json.loads(trained.to_str())["model"]["merges"]]
    path = tmp_path / "tokenizer.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|begin|>"])
    writer.add_eos_token_id(vocab["<|end|>"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, _ = tokenizer_from_gguf(gguf.GGUFReader(str(path)).fields)
    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    reference, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    for text in (MULTILINGUAL, *MULTILINGUAL.splitlines()):
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == text
