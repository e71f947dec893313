"""Build the model that ``[model]`` describes (its tokenizer: ``conveyor.model.tokenizer.load_tokenizer``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from conveyor.config import ConfigError, ModelConfig
from conveyor.model.checkpoint import Checkpoint, ModelNotFoundError, open_checkpoint
from conveyor.model.hf_quant import UnsupportedQuantization
from conveyor.model.decoder_model import DecoderModel
from conveyor.model.layers import LayerOptions
from conveyor.quant import QuantMethod

logger = logging.getLogger("conveyor")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("[model] device = 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    return torch.device(name)


def open_model(config: ModelConfig, source: str = "<config>") -> Checkpoint:
    try:
        if config.load_format == "dummy":
            from conveyor.model.dummy import DummyCheckpoint

            return DummyCheckpoint(config.path)
        return open_checkpoint(config.path)
    except (ModelNotFoundError, UnsupportedQuantization) as e:
        raise ConfigError(f"{source}: [model] path = {config.path!r}: {e}") from None


def model_len(config: ModelConfig, ckpt: Checkpoint, source: str = "<config>") -> int:
    """``max_model_len``, checked against what the model was trained for."""
    trained = ckpt.spec.max_position_embeddings
    if config.max_model_len > trained:
        raise ConfigError(
            f"{source}: [model] max_model_len = {config.max_model_len} exceeds the model's context length {trained}"
        )
    return config.max_model_len or trained


def requantize_note(ckpt: Checkpoint, quant: QuantMethod) -> str:
    """What a quant method does to a checkpoint that is quantized already, in words for the banner ("" when it
    serves the stored blocks as they are, or the checkpoint holds floats): a second rounding of 4-bit blocks to
    8 bits only costs memory and bandwidth, and a user who picked the method should learn that at start-up."""
    from conveyor.model.ggml import BLOCKS

    stored = sorted(ckpt.stored_formats())
    expanded = [f for f in stored if f not in quant.packed_formats]
    if not stored or quant.name in ("auto", "gguf"):
        return ""
    if not expanded:
        return (f"the file is quantized already ({', '.join(stored)}): its blocks are served as stored; quant "
                f"{quant.name!r} changes only weights stored as floats")
    bits = ", ".join(f"{f} ({BLOCKS[f][1] * 8 / BLOCKS[f][0]:.1f} bits a weight)" for f in expanded)
    kept = [f for f in stored if f in quant.packed_formats]
    also = f"; its {', '.join(kept)} blocks are served as stored" if kept else ""
    if quant.name == "none":
        return f"the file is quantized already ({bits}): quant 'none' expands its blocks to {quant.dtype}{also}"
    return (f"the file is quantized already ({bits}): quant {quant.name!r} expands those blocks and rounds them "
            f"again, which adds rounding error and, where its format has more bits, memory; quant.plugin = 'auto' "
            f"serves them as stored{also}")


def load_model(ckpt: Checkpoint, options: LayerOptions, max_model_len: int) -> DecoderModel:
    """The model's weights on ``options.device`` (this worker's share, by ``options.group``), with progress in
    the log."""
    start = time.perf_counter()
    where = ""
    if options.group.placement.world_size > 1:
        p = options.group.placement
        where = f", rank {p.rank}: TP {p.tp_rank + 1}/{p.tp_size}, PP stage {p.pp_rank + 1}/{p.pp_size}"
    logger.info("loading %s (%s, %s, %s%s)", ckpt.path, ckpt.spec.architecture, options.dtype, options.device, where)
    model = DecoderModel(ckpt.spec, options, max_model_len)
    load_weights(model, ckpt, progress=lambda m: logger.info("  %s", m))
    logger.info(
        "model loaded in %.1f s: %.1f MB of weights", time.perf_counter() - start, model.num_weight_bytes() / 1e6
    )
    return model


def load_weights(model: DecoderModel, ckpt: Checkpoint, progress: Callable[[str], None] | None = None) -> None:
    """Fill every block the model declared from a checkpoint of any format (GGUF, safetensors, Hugging Face
    quantized, dummy: ``Checkpoint`` reads each under Hugging Face names), each block by its own loader, layer
    after layer so that progress shows."""
    options = model.options
    start = time.perf_counter()
    for block in model.loaders():
        block.load(ckpt, options)
    for n, layer in enumerate(model.layers, 1):
        for block in layer.loaders():
            block.load(ckpt, options)
        if progress and n % max(1, len(model.layers) // 5) == 0:
            progress(f"loaded layer {n}/{len(model.layers)} ({time.perf_counter() - start:.1f} s)")
