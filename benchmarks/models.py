"""Benchmark models at the sizes people serve: GGUF files of random weights in the real shapes of Llama-3.2-1B,
Qwen2.5-1.5B and (for memory-only checks) Llama-3-8B, with the default model's tokenizer. Nothing is downloaded.

    python benchmarks/models.py --list
    python benchmarks/models.py --model llama-3.2-1b --format Q4_0          # prints the file's path
    python benchmarks/models.py --model qwen2.5-1.5b --format Q4_K_M --llama-quantize PATH

Every shape keeps the default model's vocabulary (49,152 tokens: its ``tokenizer.*`` keys and chat template are
copied), so prompts tokenize as they do for SmolLM2 and the output head is smaller than the real model's (Llama 3's
is 128,256). Weights are drawn from a normal distribution with std 0.02 (norms 1.0): activations stay finite, the
text is noise. The tensors are named (the ``gguf`` package's table) and laid out as llama.cpp's converter writes
them, so that llama.cpp reads the files as Conveyor does. Q4_0, Q8_0 and F16 are made here (the ``gguf`` package's
numpy quantizer); Q4_K_M by llama.cpp's ``llama-quantize`` from the F16 file (the numpy quantizer has no K-quants).

Files are written tensor by tensor (the 8B shape never sits in memory as floats) and kept under
``$CONVEYOR_CACHE_DIR/models`` (default ``~/.cache/conveyor/models``), named by shape, format, ``VERSION`` and a
digest of the shape, and reused. Other benchmarks call ``model_path(name, format)`` or, for their ``--model``
flag, ``resolve_model("llama-3.2-1b:Q4_0")``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import math
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from conveyor.config import paths
from conveyor.config import ModelConfig
from conveyor.model.checkpoint import resolve_model_path

# bump when the bytes written for a shape change (naming, layout, metadata, the random draw): old files are not reused
VERSION = 1
# whose tokenizer every shape takes
DEFAULT_MODEL = ModelConfig().path
WEIGHT_STD = 0.02
Q = gguf.GGMLQuantizationType
# format -> (the 2-D weights' GGUF type, general.file_type); Q4_K_M comes from llama-quantize over the F16 file
# (which keeps some tensors in Q6_K)
FORMATS: dict[str, tuple[Q, int]] = {
    "Q4_0": (Q.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "Q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "F16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "Q4_K_M": (Q.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),
}
DEFAULT_FORMAT = "Q4_0"
# elements drawn and quantized at once: bounds the memory of a tensor's float copy (an 8B FFN weight is 59M)
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Shape:
    """A model's shape as its GGUF file states it (the vocabulary is the tokenizer's)."""

    # GGUF architecture: "llama" or "qwen2"
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    # the model's own context length (general metadata; servers cap it at what their KV cache holds)
    context: int
    rope_theta: float
    rms_eps: float = 1e-5
    tied: bool = True
    # q, k and v projections with biases (Qwen2)
    qkv_bias: bool = False
    # Llama 3.1's long-context RoPE (factor, low_freq_factor, high_freq_factor, original context), written as
    # llama.cpp writes it: a divisor per frequency in ``rope_freqs.weight``
    llama3_rope: tuple[float, float, float, int] | None = None
    # what the shape is for, shown by --list
    use: str = "benchmarks"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES: dict[str, Shape] = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 131072, 500000.0,
                          llama3_rope=(32.0, 1.0, 4.0, 8192)),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, 32768, 1000000.0, rms_eps=1e-6, qkv_bias=True),
    "llama-3-8b": Shape("llama", 4096, 32, 32, 8, 14336, 8192, 500000.0, tied=False, use="memory-only checks"),
    # the same code paths at sizes a test writes in a second (RoPE scaling that shows from the first positions)
    "tiny-llama": Shape("llama", 64, 2, 4, 2, 128, 128, 500000.0, llama3_rope=(8.0, 1.0, 4.0, 16), use="tests"),
    "tiny-qwen2": Shape("qwen2", 64, 2, 4, 2, 128, 128, 1000000.0, rms_eps=1e-6, qkv_bias=True, use="tests"),
}


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the file: its GGUF name, its shape (slowest dimension first) and how it is filled."""

    name: str
    shape: tuple[int, ...]
    # "normal" (std WEIGHT_STD), "ones" (norms) or "rope_freqs"
    fill: str


def tensor_plan(shape: Shape, vocab: int) -> list[TensorPlan]:
    """Every tensor of the model, in the order written, named by the ``gguf`` package's table.

    NOTE: llama.cpp's converter reorders a Llama's Q and K rows for its RoPE (tests/gguf_writer.py's
    ``llama_cpp_permute``) and readers undo it; random rows are drawn here directly in the stored order, which is
    the same distribution, so there is nothing to permute."""
    names = gguf.TENSOR_NAMES
    T = gguf.MODEL_TENSOR
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    plan = [TensorPlan(names[T.TOKEN_EMBD] + ".weight", (vocab, shape.hidden), "normal")]
    if shape.llama3_rope:
        plan.append(TensorPlan(names[T.ROPE_FREQS] + ".weight", (shape.head_dim // 2,), "rope_freqs"))
    for i in range(shape.layers):
        layer = [
            (T.ATTN_NORM, (shape.hidden,), "ones"),
            (T.ATTN_Q, (q_rows, shape.hidden), "normal"),
            (T.ATTN_K, (kv_rows, shape.hidden), "normal"),
            (T.ATTN_V, (kv_rows, shape.hidden), "normal"),
            (T.ATTN_OUT, (shape.hidden, q_rows), "normal"),
            (T.FFN_NORM, (shape.hidden,), "ones"),
            (T.FFN_GATE, (shape.intermediate, shape.hidden), "normal"),
            (T.FFN_UP, (shape.intermediate, shape.hidden), "normal"),
            (T.FFN_DOWN, (shape.hidden, shape.intermediate), "normal"),
        ]
        for kind, dims, fill in layer:
            plan.append(TensorPlan(names[kind].format(bid=i) + ".weight", dims, fill))
            if shape.qkv_bias and kind in (T.ATTN_Q, T.ATTN_K, T.ATTN_V):
                plan.append(TensorPlan(names[kind].format(bid=i) + ".bias", dims[:1], "normal"))
    plan.append(TensorPlan(names[T.OUTPUT_NORM] + ".weight", (shape.hidden,), "ones"))
    if not shape.tied:
        plan.append(TensorPlan(names[T.OUTPUT] + ".weight", (vocab, shape.hidden), "normal"))
    return plan


def num_parameters(shape: Shape, vocab: int) -> int:
    return sum(math.prod(t.shape) for t in tensor_plan(shape, vocab) if t.fill != "rope_freqs")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def llama3_freq_factors(shape: Shape) -> np.ndarray:
    """The divisor of each RoPE frequency under Llama 3.1's scaling: 1 for short wavelengths, ``factor`` for
    those longer than the original context over ``low_freq_factor``, a smooth blend between."""
    factor, low, high, original = shape.llama3_rope
    dim = shape.head_dim
    inv_freq = 1.0 / shape.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended))
    return divisors.astype(np.float32)


@functools.cache
def tokenizer_fields() -> tuple[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None], ...]:
    """The default model's ``tokenizer.*`` keys (the chat template among them) with their GGUF types, which
    llama.cpp checks on reading: (key, value, type, item type of an array)."""
    reader = gguf.GGUFReader(resolve_model_path(DEFAULT_MODEL))
    fields = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            item = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), field.types[0], item))
    return tuple(fields)


def vocab_size() -> int:
    return len(next(value for key, value, _, _ in tokenizer_fields() if key == "tokenizer.ggml.tokens"))


def cache_dir() -> Path:
    return paths.cache_root() / "models"


def file_name(name: str, fmt: str) -> str:
    """``{name}-{format}-v{VERSION}-{digest}.gguf``: the digest covers the shape's numbers, so an edited shape is
    written anew rather than read from an older file."""
    digest = hashlib.sha256(repr(SHAPES[name]).encode()).hexdigest()[:8]
    return f"{name}-{fmt}-v{VERSION}-{digest}.gguf"


def model_path(name: str, fmt: str = DEFAULT_FORMAT, llama_quantize: str | None = None,
               log: Callable[[str], None] | None = None, directory: Path | None = None) -> Path:
    """The GGUF file of shape ``name`` in format ``fmt``, written first where the cache lacks it.

    Args:
        name: a key of ``SHAPES``.
        fmt: a key of ``FORMATS``; Q4_K_M needs ``llama_quantize``.
        llama_quantize: path of llama.cpp's ``llama-quantize`` binary.
        log: where progress lines go (default: stderr).
        directory: where files are kept (default: ``cache_dir()``).
    Returns:
        The file's path.
    Raises:
        ValueError: an unknown shape or format, or Q4_K_M without ``llama_quantize``.
    """
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    directory = directory or cache_dir()
    path = directory / file_name(name, fmt)
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    # (a file appears under its name only once complete: an interrupted run leaves no file to be reused)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        if fmt == "Q4_K_M":
            if not llama_quantize:
                raise ValueError(f"{name} Q4_K_M: the numpy quantizer has no K-quants; give llama.cpp's "
                                 "llama-quantize (--llama-quantize PATH) to make it from the F16 file")
            source = directory / file_name(name, "F16")
            temporary = not source.is_file()
            if temporary:
                source = directory / f".{file_name(name, 'F16')}.{os.getpid()}.partial"
                write_model(name, "F16", source, log)
            try:
                log(f"{name}: {llama_quantize} F16 -> Q4_K_M ...")
                subprocess.run([llama_quantize, str(source), str(partial), "Q4_K_M"], check=True,
                               stdout=subprocess.DEVNULL)
            finally:
                if temporary:
                    source.unlink(missing_ok=True)
        else:
            write_model(name, fmt, partial, log)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def write_model(name: str, fmt: str, path: Path, log: Callable[[str], None]) -> None:
    """Write shape ``name`` in ``fmt`` (Q4_0, Q8_0 or F16) to ``path``, one tensor at a time: every tensor's
    header first, then each tensor drawn, quantized and written before the next is drawn."""
    shape = SHAPES[name]
    qtype, file_type = FORMATS[fmt]
    vocab = vocab_size()
    plan = tensor_plan(shape, vocab)
    writer = gguf.GGUFWriter(str(path), shape.arch)
    writer.add_name(f"{name} (random weights)")
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(vocab)
    for key, value, kind, item in tokenizer_fields():
        writer.add_key_value(key, value, kind, sub_type=item)
    for tensor in plan:
        if len(tensor.shape) == 2:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(tensor.shape, qtype)
            writer.add_tensor_info(tensor.name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=qtype)
        else:  # (norms, biases and RoPE divisors stay float32, as llama.cpp's converter keeps them)
            writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(np.float32), 4 * math.prod(tensor.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    start = time.perf_counter()
    log(f"{name} {fmt}: writing {len(plan)} tensors ({_count(num_parameters(shape, vocab))} parameters) "
        f"to {path.parent}")
    every = max(1, shape.layers // 8)
    for tensor in plan:
        writer.write_tensor_data(tensor_data(tensor, qtype, shape))
        if tensor.name.endswith("ffn_down.weight"):
            layer = int(tensor.name.split(".")[1]) + 1
            if layer % every == 0 or layer == shape.layers:
                log(f"  {name} {fmt}: layer {layer}/{shape.layers}, {time.perf_counter() - start:.0f} s")
    writer.close()


def tensor_data(tensor: TensorPlan, qtype: Q, shape: Shape) -> np.ndarray:
    """A tensor's bytes as stored: drawn from a seed of its own name (the same file every time), in chunks of
    rows so that only one chunk is ever held as float32."""
    if tensor.fill == "ones":
        return np.ones(tensor.shape, dtype=np.float32)
    if tensor.fill == "rope_freqs":
        return llama3_freq_factors(shape)
    rng = np.random.default_rng([VERSION, zlib.crc32(tensor.name.encode())])
    if len(tensor.shape) == 1:
        return rng.standard_normal(tensor.shape, dtype=np.float32) * np.float32(WEIGHT_STD)
    rows, columns = tensor.shape
    if qtype == Q.F16:
        out = np.empty(tensor.shape, dtype=np.float16)
    else:
        out = np.empty(gguf.quants.quant_shape_to_byte_shape(tensor.shape, qtype), dtype=np.uint8)
    step = max(1, CHUNK_ELEMENTS // columns)
    for first in range(0, rows, step):
        chunk = rng.standard_normal((min(step, rows - first), columns), dtype=np.float32)
        chunk *= np.float32(WEIGHT_STD)
        out[first:first + len(chunk)] = chunk if qtype == Q.F16 else gguf.quants.quantize(chunk, qtype)
    return out


def resolve_model(value: str) -> str:
    """A benchmark's ``--model`` as a ``model.path``: ``SHAPE`` or ``SHAPE:FORMAT`` (written or taken from the
    cache; the format defaults to Q4_0), else the value as given (a .gguf file, a Hugging Face directory, an
    alias)."""
    name, _, fmt = value.partition(":")
    if name in SHAPES:
        return str(model_path(name, fmt or DEFAULT_FORMAT))
    return value


def list_shapes() -> str:
    vocab = vocab_size()
    lines = [("| shape | architecture | parameters | hidden | layers | heads / KV heads | intermediate | tied "
              "| context | for | cached |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in SHAPES.items():
        cached = [fmt for fmt in FORMATS if (cache_dir() / file_name(name, fmt)).is_file()]
        lines.append(f"| {name} | {s.arch} | {_count(num_parameters(s, vocab))} | {s.hidden} | {s.layers} "
                     f"| {s.heads} / {s.kv_heads} | {s.intermediate} | {'yes' if s.tied else 'no'} | {s.context} "
                     f"| {s.use} | {', '.join(cached) or '-'} |")
    return "\n".join(lines) + f"\n\nvocabulary {vocab} (the default model's tokenizer); files in {cache_dir()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(SHAPES), help="the shape to write (its path is printed)")
    parser.add_argument("--format", default=DEFAULT_FORMAT, choices=list(FORMATS))
    parser.add_argument("--llama-quantize", metavar="PATH", help="llama.cpp's llama-quantize, for Q4_K_M")
    parser.add_argument("--list", action="store_true", help="list the shapes and the files already written")
    args = parser.parse_args()
    if args.list or not args.model:
        print(list_shapes())
        return 0
    if args.format == "Q4_K_M" and not args.llama_quantize:
        print(f"skipped {args.model} Q4_K_M: the numpy quantizer has no K-quants; give llama.cpp's llama-quantize "
              "(--llama-quantize PATH) to make it from the F16 file", file=sys.stderr)
        return 2
    print(model_path(args.model, args.format, args.llama_quantize))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
