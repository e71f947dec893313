"""Tokenizer: Hugging Face ``tokenizers`` built from GGUF metadata or tokenizer.json,
plus the model's chat template rendered with a sandboxed jinja2."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

if TYPE_CHECKING:
    from conveyor.config import ModelConfig

# GPT-2's split: contractions, letters, digits, other symbols, spaces.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (bad roles, missing template, ...)."""


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for a ``tokenizer.ggml.pre`` value."""
    if pre in ("llama-bpe", "llama3", "dbrx", "smaug-bpe"):
        split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in ("qwen2", "deepseek-r1-qwen"):
        split = pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # Each digit is its own pre-token, then GPT-2's split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def tokenizer_from_gguf(fields: dict[str, Any]) -> tuple[HFTokenizer, dict[str, Any]]:
    """Build a byte-level BPE tokenizer from GGUF ``tokenizer.ggml.*`` metadata.

    Returns:
        The tokenizer and its settings: bos/eos ids, add_bos, chat_template.
    """

    def get(key: str, default: Any = None) -> Any:
        return fields.get(key, default)

    kind = get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE); "
            "set [model] tokenizer to a tokenizer.json"
        )
    tokens: list[str] = get("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", [])]
    types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tokenizer = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)
    settings = {
        "bos_token_id": get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": get("tokenizer.ggml.eos_token_id"),
        "eot_token_id": get("tokenizer.ggml.eot_token_id"),
        "add_bos": bool(get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": get("tokenizer.chat_template"),
    }
    return tokenizer, settings


def tokenizer_from_dir(path: Path) -> tuple[HFTokenizer, dict[str, Any]]:
    """Load tokenizer.json and the settings in tokenizer_config.json / generation_config.json."""
    directory = path if path.is_dir() else path.parent
    file = path if path.is_file() else path / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {str(path)!r}")
    tokenizer = HFTokenizer.from_file(str(file))

    def read(name: str) -> dict[str, Any]:
        f = directory / name
        return json.loads(f.read_text()) if f.is_file() else {}

    config, generation, model_config = read("tokenizer_config.json"), read("generation_config.json"), read("config.json")

    def token_id(value: Any) -> int | None:
        if isinstance(value, dict):
            value = value.get("content")
        return tokenizer.token_to_id(value) if isinstance(value, str) else None

    template = config.get("chat_template")
    template_file = directory / "chat_template.jinja"
    if template is None and template_file.is_file():
        template = template_file.read_text()
    eos = generation.get("eos_token_id", model_config.get("eos_token_id"))
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    config_eos = token_id(config.get("eos_token"))
    if config_eos is not None:
        eos_ids.append(config_eos)
    settings = {
        "bos_token_id": token_id(config.get("bos_token")) or generation.get("bos_token_id"),
        "eos_token_id": eos_ids[0] if eos_ids else None,
        "extra_eos_ids": eos_ids[1:],
        "add_bos": bool(config.get("add_bos_token", False)),
        "chat_template": template,
    }
    return tokenizer, settings


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _text_message(index: int, message: Any) -> dict[str, Any]:
    """A message with string content (OpenAI text parts are joined)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ChatTemplateError(f"messages[{index}] must be an object with a string 'role'")
    if message["role"] not in CHAT_ROLES:
        raise ChatTemplateError(f"messages[{index}].role = {message['role']!r}: allowed: {', '.join(CHAT_ROLES)}")
    if message.get("content") is None and message["role"] != "assistant":
        raise ChatTemplateError(f"messages[{index}] ({message['role']}) has no content")
    content = message.get("content") or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError(f"messages[{index}].content: only text parts are supported")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ChatTemplateError(f"messages[{index}].content must be a string or a list of text parts")
    return {**message, "content": content}


class Tokenizer:
    """Text <-> token ids for one model, and its chat template."""

    def __init__(self, tokenizer: HFTokenizer, settings: dict[str, Any]):
        self.hf = tokenizer
        self.bos_token_id: int | None = settings.get("bos_token_id")
        self.eos_token_id: int | None = settings.get("eos_token_id")
        self.add_bos: bool = settings.get("add_bos", False)
        self.chat_template: str | None = settings.get("chat_template")
        ends = [settings.get("eos_token_id"), settings.get("eot_token_id"), *settings.get("extra_eos_ids", [])]
        # every id that ends a generation unless ignore_eos is set
        self.eos_token_ids: frozenset[int] = frozenset(i for i in ends if i is not None)

    @classmethod
    def load(cls, model_path: Path, tokenizer_path: str = "", gguf_fields: dict[str, Any] | None = None) -> Tokenizer:
        """The tokenizer of a model: an explicit tokenizer.json, else the one in the checkpoint."""
        if tokenizer_path:
            return cls(*tokenizer_from_dir(Path(tokenizer_path).expanduser()))
        if gguf_fields is not None:
            return cls(*tokenizer_from_gguf(gguf_fields))
        return cls(*tokenizer_from_dir(model_path))

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; a BOS is prepended when the model asks for one. A long text takes seconds, during
        which other threads run (an event loop that calls it in a worker thread goes on)."""
        # NOTE: tokenizers' encode() holds the GIL throughout (2 s for a 4 MB prompt on a 2-core EPYC, when no
        # other thread runs, the event loop included); encode_batch() releases it while it works
        ids = self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token (as OpenAI logprobs show it)."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI logprobs' ``bytes``, from which a client rebuilds characters
        split across tokens: such a token's text shows U+FFFD, its bytes part of the character's UTF-8)."""
        token = self.hf.id_to_token(token_id)
        if token is not None and token_id not in self._added_ids:
            chars = self._byte_level_chars
            if chars is not None and all(c in chars for c in token):
                return bytes(chars[c] for c in token)
            # (SentencePiece's byte fallback)
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                try:
                    return bytes([int(token[3:5], 16)])
                except ValueError:
                    pass
            if self._spaces_as_metaspace:  # (decoding the token alone would drop a leading space)
                return token.replace("\u2581", " ").encode()
        return self.token_text(token_id).encode()

    @cached_property
    def _decoder_kinds(self) -> set[str]:
        decoder = json.loads(self.hf.to_str()).get("decoder") or {}
        return {decoder.get("type"), *(d.get("type") for d in decoder.get("decoders") or [])}

    @cached_property
    def _spaces_as_metaspace(self) -> bool:
        """Whether the vocabulary writes spaces as U+2581 (SentencePiece's)."""
        return "Metaspace" in self._decoder_kinds or "Replace" in self._decoder_kinds

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.hf.get_added_tokens_decoder())

    @cached_property
    def _byte_level_chars(self) -> dict[str, int] | None:
        """For a byte-level BPE (GPT-2's scheme, decoded by a ByteLevel decoder): the character each byte is
        written as in the vocabulary (printable bytes as themselves, the others as characters from U+0100 on, in
        byte order), mapped back to the byte. None for other tokenizers."""
        if "ByteLevel" not in self._decoder_kinds:
            return None
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        others = [b for b in range(256) if b not in printable]
        return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}

    @cached_property
    def _template(self):
        if not self.chat_template:
            return None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(message: str):
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda v, indent=None, ensure_ascii=False, **_: json.dumps(
            v, indent=indent, ensure_ascii=ensure_ascii
        )
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **context: Any) -> str:
        """Render a conversation to the prompt text the model was trained on (``context``: more variables the
        template may read, e.g. ``tools``). ``continue_final_message``: the last message (the assistant's
        start of a reply) stays open, its end-of-turn markup cut, so that the model goes on with it.

        Raises:
            ChatTemplateError: no template, malformed messages, or the template refused them.
        """
        if continue_final_message:
            return self._continued(messages, context)
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead (the server's "
                                    "[model] chat_template gives it one)")
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("messages must be a non-empty list")
        messages = [_text_message(i, m) for i, m in enumerate(messages)]
        token = self.hf.id_to_token
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=token(self.bos_token_id) if self.bos_token_id is not None else "",
                eos_token=token(self.eos_token_id) if self.eos_token_id is not None else "",
                **context,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from None

    def _continued(self, messages: list[dict[str, Any]], context: dict[str, Any]) -> str:
        """The conversation rendered without a generation prompt and cut after its last message's text (as
        transformers' ``continue_final_message`` does: the text as the template wrote it, spaces at its end
        included where the template kept them)."""
        rendered = self.apply_chat_template(messages, False, **context)
        last = messages[-1] if isinstance(messages, list) and messages else {}
        text = last.get("content") if isinstance(last, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise ChatTemplateError("continuing the final message needs it to have text")
        at = rendered.rfind(text.strip())
        if at < 0:
            raise ChatTemplateError("the chat template does not write the final message's text as given")
        kept = text.lstrip()
        end = at + (len(kept) if rendered.startswith(kept, at) else len(text.strip()))
        return rendered[:end]

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **context: Any) -> list[int]:
        # The template writes any BOS itself.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **context),
                           add_special_tokens=False)


def load_tokenizer(config: ModelConfig, source: str = "<config>") -> Tokenizer:
    """The tokenizer of ``[model]``: an explicit tokenizer.json, else the checkpoint's own (GGUF metadata or
    tokenizer.json beside the weights), read without loading any weight; with ``[model] chat_template``'s template.

    Raises:
        ConfigError: the model is not where ``[model] path`` says, or the chat template is not where its key says.
    """
    tokenizer = _checkpoint_tokenizer(config, source)
    if config.chat_template:
        tokenizer.chat_template = read_chat_template(config.chat_template, source)
    return tokenizer


def read_chat_template(value: str, source: str = "<config>") -> str:
    """``[model] chat_template``: the template itself where it holds Jinja's ``{%`` or ``{{``, else a file's text.

    Raises:
        ConfigError: no such file, or a template Jinja cannot parse (its line and why).
    """
    from jinja2 import TemplateSyntaxError

    from conveyor.config import ConfigError

    where = f"{source}: [model] chat_template"
    template = value
    if "{%" not in value and "{{" not in value:
        try:
            template = Path(value).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{where} = {value!r}: expected a Jinja template file or the template itself "
                              f"(text holding '{{%' or '{{{{'): {getattr(e, 'strerror', None) or e}") from None
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except TemplateSyntaxError as e:
        raise ConfigError(f"{where}: not a valid Jinja template: line {e.lineno}: {e.message}") from None
    return template


def _checkpoint_tokenizer(config: ModelConfig, source: str) -> Tokenizer:
    from conveyor.config import ConfigError
    from conveyor.model.checkpoint import ModelNotFoundError, resolve_model_path

    if config.tokenizer:
        try:
            return Tokenizer.load(Path(config.path), config.tokenizer)
        except FileNotFoundError:
            raise ConfigError(f"{source}: [model] tokenizer = {config.tokenizer!r}: no tokenizer.json there "
                              "(name the file, or a directory that holds one)") from None
    try:
        path = resolve_model_path(config.path)
    except ModelNotFoundError as e:
        raise ConfigError(f"{source}: [model] path = {config.path!r}: {e}") from None
    if path.suffix == ".gguf":
        from conveyor.model.gguf_file import GGUFFile

        return Tokenizer.load(path, gguf_fields=GGUFFile(path).fields)
    if path.is_dir() and not (path / "config.json").is_file() and config.load_format != "dummy":
        raise ConfigError(f"{source}: [model] path = {config.path!r}: the directory has no config.json (a Hugging "
                          "Face model directory holds config.json, *.safetensors and tokenizer.json)")
    try:
        return Tokenizer.load(path)
    except FileNotFoundError:
        raise ConfigError(f"{source}: [model] path = {config.path!r}: no tokenizer.json in the directory; set "
                          "[model] tokenizer to a tokenizer.json (or a directory that holds one)") from None
