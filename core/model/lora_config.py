"""A LoRA adapter's directory read and checked without torch: the frontend does this when an adapter is loaded
at runtime, before any worker reads its weights (``conveyor.model.lora``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterConfig:
    """What an adapter's ``adapter_config.json`` says, checked."""

    rank: int
    # the factor on B @ A: lora_alpha / r (rsLoRA: / sqrt(r))
    scale: float


def read_adapter_config(path: str | Path, max_rank: int) -> AdapterConfig:
    """Read and check a PEFT LoRA adapter's directory without loading its weights.

    Raises:
        ValueError: the directory is not a LoRA adapter Conveyor can serve (the message says why).
    """
    root = Path(path)
    if not (root / "adapter_config.json").is_file():
        raise ValueError(f"{path}: no adapter_config.json (a PEFT adapter directory is expected)")
    if not (root / WEIGHTS_FILE).is_file():
        found = " (adapter_model.bin is a pickle, which is not loaded)" if (root / "adapter_model.bin").exists() else ""
        raise ValueError(f"{path}: no {WEIGHTS_FILE}{found}")
    try:
        raw = json.loads((root / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}/adapter_config.json: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}/adapter_config.json: not a JSON object")  # noqa: TRY004 - a bad file
    unsupported = [
        ("peft_type", raw.get("peft_type", "LORA") != "LORA", "only LORA"),
        ("use_dora", bool(raw.get("use_dora")), "DoRA is not supported"),
        ("bias", raw.get("bias", "none") != "none", "only 'none' (no trained biases)"),
        ("fan_in_fan_out", bool(raw.get("fan_in_fan_out")), "only false (Linear layers)"),
        ("rank_pattern", bool(raw.get("rank_pattern")), "one rank for every module"),
        ("alpha_pattern", bool(raw.get("alpha_pattern")), "one alpha for every module"),
        ("modules_to_save", bool(raw.get("modules_to_save")), "whole modules replaced are not supported"),
    ]
    for key, bad, allowed in unsupported:
        if bad:
            raise ValueError(f"{path}/adapter_config.json: {key} = {raw.get(key)!r}: {allowed}")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{path}/adapter_config.json: r = {rank!r}: a positive integer is expected")
    if rank > max_rank:
        raise ValueError(f"{path}: rank {rank} exceeds [lora] max_lora_rank = {max_rank}")
    if not isinstance(alpha, (int, float)):
        raise ValueError(f"{path}/adapter_config.json: lora_alpha = {alpha!r}: a number is expected")  # noqa: TRY004
    return AdapterConfig(rank, alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank))
