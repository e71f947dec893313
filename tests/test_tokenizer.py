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

    from conveyor.model.gguf_file import GGUFFile
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

    ours, _ = tokenizer_from_gguf(GGUFFile(path).fields)
    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    reference, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    for text in (MULTILINGUAL, *MULTILINGUAL.splitlines()):
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == text


# Templates in the shape of each family's (the constructs their checkpoints' templates use: BOS and header
# tokens, a system turn folded into the first user turn with role alternation enforced, a namespace and a
# reversed scan that strip earlier thinking, a generation prompt or an EOS at the end).
FAMILY_TEMPLATES = {
    "llama3": (
        "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    ),
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + "
        "'\\n\\n' %}{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}"
        "{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
        " + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
    ),
    "qwen3": (
        "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
        "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
        "{%- if ns.multi_step_tool and message.role == 'user' %}{%- set ns.multi_step_tool = false %}"
        "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
        "{%- for message in messages %}{%- set content = message.content %}"
        "{%- if message.role == 'assistant' and '</think>' in content %}"
        "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
        "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
        "{%- if loop.index0 > ns.last_query_index %}{%- set content = '<think>\\n' + reasoning + '\\n</think>\\n\\n'"
        " + content %}{%- endif %}{%- endif %}"
        "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
    "phi3": (
        "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + "
        "'<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
        "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}"
        "{% endif %}"
    ),
}
CONVERSATION = [
    {"role": "system", "content": "You are terse. "},
    {"role": "user", "content": " What is 2 + 2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    {"role": "user", "content": "And 3 + 3?"},
]


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_family_chat_templates_render_as_transformers_renders_them(tokenizer, family, add_generation_prompt):
    from transformers.utils.chat_template_utils import render_jinja_template

    template = FAMILY_TEMPLATES[family]
    ours = Tokenizer(tokenizer.hf, {"chat_template": template, "bos_token_id": 1, "eos_token_id": 2})
    rendered, _ = render_jinja_template(
        [CONVERSATION], chat_template=template, add_generation_prompt=add_generation_prompt,
        bos_token=tokenizer.hf.id_to_token(1), eos_token=tokenizer.hf.id_to_token(2),
    )
    assert ours.apply_chat_template(CONVERSATION, add_generation_prompt) == rendered[0]


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATES))
@pytest.mark.parametrize("start", ["The answer is", "The answer is ", "  4"])
def test_a_continued_final_message_renders_as_transformers_renders_it(tokenizer, family, start):
    """continue_final_message: the last (assistant) message left open for the model to go on with, its spaces as
    the template kept them."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = FAMILY_TEMPLATES[family]
    ours = Tokenizer(tokenizer.hf, {"chat_template": template, "bos_token_id": 1, "eos_token_id": 2})
    conversation = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": start}]
    rendered, _ = render_jinja_template(
        [conversation], chat_template=template, continue_final_message=True, add_generation_prompt=False,
        bos_token=tokenizer.hf.id_to_token(1), eos_token=tokenizer.hf.id_to_token(2),
    )
    assert ours.apply_chat_template(conversation, False, continue_final_message=True) == rendered[0]


def test_a_template_that_refuses_the_conversation_says_why(tokenizer):
    gemma = Tokenizer(tokenizer.hf, {"chat_template": FAMILY_TEMPLATES["gemma"]})
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        gemma.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_model_directory_without_its_files_is_a_config_error_naming_the_key(tmp_path):
    """What a new user meets first: each missing file named with the [model] key that fixes it, before the
    engine starts (load_tokenizer runs in the frontend first)."""
    import json

    from conveyor.config import ConfigError, ModelConfig
    from conveyor.model.tokenizer import load_tokenizer

    with pytest.raises(ConfigError, match=r"^mine.toml: \[model\] path = '.*': the directory has no config.json"):
        load_tokenizer(ModelConfig(path=str(tmp_path)), "mine.toml")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"no tokenizer.json in the directory; set \[model\] tokenizer to"):
        load_tokenizer(ModelConfig(path=str(tmp_path)), "mine.toml")
    with pytest.raises(ConfigError, match=r"^mine.toml: \[model\] tokenizer = 'nowhere': no tokenizer.json there"):
        load_tokenizer(ModelConfig(path=str(tmp_path), tokenizer="nowhere"), "mine.toml")


def test_token_bytes_rebuild_characters_that_tokens_split(tokenizer):
    """OpenAI logprobs' ``bytes``: joined over a reply's tokens they are its UTF-8, also where a token ends inside
    a character (its text then shows U+FFFD): SmolLM2's byte-level BPE, and a SentencePiece vocabulary that falls
    back to byte tokens for characters it lacks."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    ids = tokenizer.encode(MULTILINGUAL)
    assert any("\ufffd" in tokenizer.token_text(i) for i in ids)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == MULTILINGUAL.encode()
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    vocab |= {c: len(vocab) + i for i, c in enumerate(["\u2581", *map(chr, range(33, 127))])}
    spm = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    spm.pre_tokenizer = pre_tokenizers.Metaspace()
    spm.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    ours = Tokenizer(spm, {})
    text = "naïve café 日本 👍🏽 ok"
    ids = ours.encode(text)
    assert ours.decode(ids) == text and any(spm.id_to_token(i).startswith("<0x") for i in ids)
    assert b"".join(ours.token_bytes(i) for i in ids) == b" " + text.encode()  # (Metaspace's leading space)


def test_tokenizing_leaves_the_gil_to_other_threads(tokenizer):
    """An event loop calls encode() in a worker thread and goes on meanwhile: tokenizing must leave the GIL. With
    the switch interval at 100 s no thread gives the GIL up but by blocking, so this thread gets it back from the
    worker only if tokenizing leaves it: it then runs its own code and sees the worker not yet done (encode()
    holding the GIL throughout: the worker ends first). The ids are the usual ones, BOS rules and all."""
    import sys
    import threading

    text = "The sky is blue. " * 10_000
    result: list[list[int]] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100)
    try:
        worker = threading.Thread(target=lambda: result.append(tokenizer.encode(text)))
        worker.start()  # (this thread waits for it to start: the GIL goes to the worker)
        done_meanwhile = bool(result)
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert not done_meanwhile
    expected = tokenizer.hf.encode(text, add_special_tokens=False).ids
    assert result[0] == ([tokenizer.bos_token_id] if tokenizer.add_bos else []) + expected
    assert tokenizer.encode(text, add_special_tokens=False) == expected
