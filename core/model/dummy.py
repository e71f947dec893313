"""Random weights of a model's shape (``[model] load_format = "dummy"``), as vLLM's dummy load format.

The shape comes from ``model.path``: a Hugging Face config.json (a directory holding one, or the file),
so a model can be benchmarked and its kernels checked without its weights; nothing is downloaded. Each
tensor is drawn from a generator seeded by its name: every worker, and every run, sees the same weights,
so tensor-parallel shards fit together and two configs can be compared token for token. Projections
are scaled by 1/sqrt(fan-in) and norms are 1, so activations stay finite through every layer. Dense
models only (a mixture of experts is refused with the reason).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from conveyor.model.checkpoint import Checkpoint, ModelNotFoundError
from conveyor.model.families import spec_from_hf_config


class DummyCheckpoint(Checkpoint):
    def __init__(self, path: str | Path, seed: int = 0):
        config_file = Path(path).expanduser()
        if config_file.is_dir():
            config_file = config_file / "config.json"
        if not config_file.is_file():
            raise ModelNotFoundError(f"load_format = 'dummy' takes the shape from a config.json: {str(path)!r} "
                                     "is neither one nor a directory holding one")
        self.path = config_file.parent
        self.spec = spec_from_hf_config(json.loads(config_file.read_text()))
        if getattr(self.spec, "num_experts", 0):
            raise ModelNotFoundError(f"{config_file}: load_format = 'dummy' makes dense models only, "
                                     "not a mixture of experts")
        self.seed = seed

    def _shape(self, name: str) -> tuple[int, ...] | None:
        s = self.spec
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (s.vocab_size, s.hidden_size)
        if name.endswith(("norm.weight", "layernorm.weight")):
            return (s.head_dim,) if name.endswith(("q_norm.weight", "k_norm.weight")) else (s.hidden_size,)
        projection, _, kind = name.rpartition(".")
        outputs, inputs = {
            "self_attn.q_proj": (q, s.hidden_size), "self_attn.k_proj": (kv, s.hidden_size),
            "self_attn.v_proj": (kv, s.hidden_size), "self_attn.o_proj": (s.hidden_size, q),
            "mlp.gate_proj": (s.intermediate_size, s.hidden_size), "mlp.up_proj": (s.intermediate_size, s.hidden_size),
            "mlp.down_proj": (s.hidden_size, s.intermediate_size),
        }.get(projection.partition(".layers.")[2].partition(".")[2], (0, 0))
        if not outputs or ".layers." not in name:
            return None
        return (outputs, inputs) if kind == "weight" else (outputs,)

    def tensor(self, name: str) -> torch.Tensor:
        shape = self._shape(name)
        if shape is None:
            raise KeyError(f"{self.path}: a dummy checkpoint has no tensor {name!r}")
        if name.endswith("norm.weight"):
            return torch.full(shape, 1.0 - self.spec.norm_weight_offset)
        if len(shape) == 1:  # a bias
            return torch.zeros(shape)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        scale = 1.0 if "embed_tokens" in name else shape[1] ** -0.5
        return torch.randn(shape, generator=generator).mul_(scale)
