"""A GGUF file's header read in one pass: its key-value metadata as Python values, its tensors as arrays that
map the file.

NOTE: ``gguf.GGUFReader`` makes numpy views of the file for every value of an array, two per string: for
SmolLM2's 49k-token vocabulary and 48k merges that is 3.5 s and 70 MB of Python objects on a 2-core Zen 4, paid
at every start by the frontend (the tokenizer) and again by the engine (the checkpoint). ``struct`` over the
same bytes takes 0.2 s. The ``gguf`` package still names the types, sizes their blocks and dequantizes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

VERSIONS = (2, 3)
# GGUFValueType -> struct format (little-endian) of the scalar types
_SCALARS = {
    gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b", gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h", gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f", gguf.GGUFValueType.BOOL: "<?", gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q", gguf.GGUFValueType.FLOAT64: "<d",
}
# the numpy dtype of a tensor's elements, for the types not stored in blocks
_ELEMENTS = {
    gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    # GGUF's order: the fastest-varying dimension first
    shape: tuple[int, ...]
    n_bytes: int
    # maps the file, shaped as gguf.GGUFReader shapes it: elements in torch's order (slowest first) for float
    # and integer types, bytes (a row of blocks in the last dimension) for block types
    data: np.ndarray


class GGUFFile:
    """The metadata (``fields``: key -> a str, int, float, bool or list) and ``tensors`` of a ``.gguf`` file.

    Raises:
        ValueError: not a GGUF file, a version other than ``VERSIONS``, or a big-endian one.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._map = np.memmap(self.path, mode="r")
        self._view = memoryview(self._map)
        if bytes(self._view[:4]) != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file")
        self._offset = 4
        version = self._unpack("<I")
        if version not in VERSIONS:
            swapped = struct.unpack(">I", struct.pack("<I", version))[0]
            kind = "a big-endian GGUF file" if swapped in VERSIONS else f"GGUF version {version}"
            raise ValueError(f"{self.path}: {kind} is not supported (little-endian versions "
                             f"{', '.join(map(str, VERSIONS))})")
        num_tensors, num_fields = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            infos.append((name, dims, gguf.GGMLQuantizationType(self._unpack("<I")), self._unpack("<Q")))
        alignment = int(self.fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._view, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        text = str(self._view[self._offset:self._offset + length], "utf-8")
        self._offset += length
        return text

    def _value(self, kind: int) -> Any:
        kind = gguf.GGUFValueType(kind)
        if kind == gguf.GGUFValueType.STRING:
            return self._string()
        if kind != gguf.GGUFValueType.ARRAY:
            return self._unpack(_SCALARS[kind])
        item, count = gguf.GGUFValueType(self._unpack("<I")), self._unpack("<Q")
        if item in _SCALARS:  # (numbers in one read)
            fmt = _SCALARS[item]
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", self._view, self._offset))
            self._offset += count * struct.calcsize(fmt)
            return values
        return [self._value(item) for _ in range(count)]

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: gguf.GGMLQuantizationType,
                offset: int) -> GGUFTensor:
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        elements = int(np.prod(dims))
        n_bytes = elements * block_bytes // block
        shape = tuple(reversed(dims))
        if kind in _ELEMENTS:
            dtype = _ELEMENTS[kind]
        else:
            dtype, shape = np.uint8, gguf.quants.quant_shape_to_byte_shape(shape, kind)
        data = self._map[start + offset:start + offset + n_bytes].view(dtype).reshape(shape)
        return GGUFTensor(name, kind, dims, n_bytes, data)
