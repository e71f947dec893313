"""Conveyor's GGUF header reader against the gguf package's own reader (gguf.GGUFReader): the same metadata and
the same tensor bytes, on a file with every value type and on the default model's file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from conveyor.model.gguf_file import GGUFFile

T, V = gguf.GGMLQuantizationType, gguf.GGUFValueType


def assert_same_as_gguf_reader(path) -> GGUFFile:
    ours, reference = GGUFFile(path), gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert list(ours.fields) == list(expected)  # (in the file's order)
    assert len(ours.tensors) == len(reference.tensors)
    for a, b in zip(ours.tensors, reference.tensors):
        assert (a.name, a.tensor_type, a.shape, a.n_bytes) == (b.name, b.tensor_type, tuple(b.shape.tolist()),
                                                              b.n_bytes)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
    return ours


def test_every_value_type_and_tensor_kind_reads_as_gguf_reads_it(tmp_path):
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(4096)  # (tensor data starts at the file's own alignment, not the default 32)
    scalars = {V.UINT8: 200, V.INT8: -100, V.UINT16: 60000, V.INT16: -30000, V.UINT32: 4_000_000_000,
               V.INT32: -2_000_000_000, V.FLOAT32: 1.5, V.UINT64: 2**63 + 5, V.INT64: -(2**62), V.FLOAT64: 2.0**-40,
               V.BOOL: True}
    for kind, value in scalars.items():
        writer.add_key_value(f"test.{kind.name.lower()}", value, kind)
    writer.add_string("test.string", "naïve ☕ text")
    writer.add_array("test.strings", ["a", "", "ünï", "merges a b"])
    writer.add_key_value("test.int32s", [1, -2, 3], V.ARRAY, sub_type=V.INT32)
    writer.add_key_value("test.floats", [0.5, -1.25], V.ARRAY, sub_type=V.FLOAT32)
    writer.add_key_value("test.bools", [True, False, True], V.ARRAY, sub_type=V.BOOL)
    writer.add_key_value("test.uint64s", [2**40, 7], V.ARRAY, sub_type=V.UINT64)
    generator = np.random.default_rng(0)
    writer.add_tensor("f32", generator.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", generator.standard_normal((4, 2, 6)).astype(np.float16))
    for kind in (T.Q8_0, T.Q4_1):
        weights = generator.standard_normal((4, 512)).astype(np.float32)
        writer.add_tensor(kind.name, gguf.quants.quantize(weights, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = assert_same_as_gguf_reader(path)
    assert ours.fields["test.uint64"] == 2**63 + 5 and ours.fields["test.bools"] == [True, False, True]
    assert [t.name for t in ours.tensors] == ["f32", "f16", "Q8_0", "Q4_1"]
    assert ours.tensors[3].data.shape == (4, 512 // 32 * 20)  # (rows of blocks, as bytes)


def test_the_default_models_file_reads_as_gguf_reads_it(smollm2_path):
    ours = assert_same_as_gguf_reader(smollm2_path)
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152


def test_files_it_cannot_read_are_named_with_the_reason(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(ValueError, match=r"notes.gguf: not a GGUF file"):
        GGUFFile(text)
    big = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(big), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"big.gguf: a big-endian GGUF file is not supported \(little-endian "
                                         r"versions 2, 3\)"):
        GGUFFile(big)
