"""The quantization-method interface (plugin kind ``quant``).

A quant method turns each full-precision linear weight into the tensors it
stores (``prepare``) and multiplies activations by them (``linear``). The
model keeps embeddings, norms and the output head in the model dtype; every
other linear layer goes through the selected method.

A method that lists stored formats in ``packed_formats`` also takes weights
the checkpoint holds already quantized, as they are stored
(``prepare_packed``: GGUF's blocks, e.g. ``"Q4_1"``), and then the loader
never expands them. Where it takes the embedding table's format, the model
keeps that table packed as well (rows are dequantized as they are looked
up) and its tied output head goes through ``prepare_packed`` too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import msgspec

if TYPE_CHECKING:
    import torch

    from conveyor.model.ggml import PackedWeight

# NOTE: torch only for annotations here: the interface stays as light to import as the plugins' declarations
# (conveyor.plugins.quant.declarations), which the server's frontend reads to check a config without torch.

Params = dict[str, "torch.Tensor"]


# NativeWeight.type_id of fp8 e4m3 weights with a scale per output row (GGML block types: their
# conveyor.model.ggml.TYPE_IDS, from 0)
FP8_TYPE_ID = -1


class NativeWeight(NamedTuple):
    """A linear layer's weights as the one-call decode step (``conveyor.native.decode_layers``) multiplies them."""

    # GGML blocks: uint8 ``[out, row bytes]``; fp8: float8_e4m3fn ``[out, in]``
    weight: torch.Tensor
    # the blocks' conveyor.model.ggml.TYPE_IDS number, or FP8_TYPE_ID
    type_id: int
    # fp8: float32 ``[out]``, each row's scale; None for blocks
    scale: torch.Tensor | None = None
    # the most rows of a step the method multiplies with this kernel (beyond, another way); None: any
    max_rows: int | None = None


class NoOptions(msgspec.Struct, forbid_unknown_fields=True):
    """A plugin with no options of its own."""


class QuantMethod(ABC):
    """Stores and applies linear-layer weights in one format."""

    name: ClassVar[str]
    Options: ClassVar[type[msgspec.Struct]] = NoOptions
    # stored formats ``prepare_packed`` takes (GGUF block types by name); empty: float32 weights only
    packed_formats: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, options: msgspec.Struct | None, dtype: torch.dtype, device: torch.device):
        """
        Args:
            options: an instance of ``Options`` (the TOML table's other keys); None: its defaults.
            dtype: the model's activation dtype.
            device: where the weights live.
        """
        self.options = options if options is not None else self.Options()
        self.dtype = dtype
        self.device = device

    @abstractmethod
    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Params:
        """Convert one weight.

        Args:
            weight: ``[out_features, in_features]`` float32, on the CPU.
            bias: ``[out_features]`` float32 or None.

        Returns:
            The tensors to store, on ``self.device``.
        """

    def prepare_input_shard(self, weight: torch.Tensor, columns: slice) -> Params:
        """Convert a row-parallel layer's share of one weight under tensor parallelism: every output row,
        the input ``columns`` (the workers' partial products are summed after).

        The default quantizes those columns alone, which is right for a method whose numbers for a column
        do not depend on the other columns. A method with a scale per output row overrides it so that
        each worker keeps the whole row's scale (quantize, then split): the same numbers as one worker.
        Column-parallel layers need no hook: each worker prepares its rows with ``prepare``.

        Args:
            weight: ``[out_features, in_features]`` float32, on the CPU (the whole weight).
            columns: the input features this worker multiplies.

        Returns:
            The tensors to store, on ``self.device``, as ``prepare`` returns them for those columns.
        """
        return self.prepare(weight[:, columns].contiguous())

    def prepare_packed(self, parts: list[PackedWeight], bias: torch.Tensor | None = None) -> Params:
        """Take a weight as the checkpoint stores it, without expanding it (only formats in ``packed_formats``).

        Args:
            parts: pieces of the weight stacked along the output features, each in one stored format (the
                loader fuses Q, K, V and gate, up, whose formats may differ); under tensor parallelism each
                is already this worker's share, cut along whole blocks.
            bias: ``[out_features]`` float32 or None.

        Returns:
            The tensors to store, on ``self.device``.
        """
        raise NotImplementedError(f"quant method {self.name!r} takes no packed weights")

    def packed_table(self, params: Params) -> PackedWeight | None:
        """What ``prepare_packed`` kept of a one-part weight, as a ``PackedWeight`` in the layout it is kept in
        (where that is one ``conveyor.model.ggml`` dequantizes): a tied embedding then looks its rows up in the
        head's bytes instead of holding the table twice.

        Args:
            params: what ``prepare_packed`` returned for a one-part weight.

        Returns:
            The kept weight, or None (the default): nothing to share.
        """
        return None

    def native_weight(self, params: Params) -> NativeWeight | None:
        """The weights as ``conveyor.native.decode_layers`` multiplies them, where ``linear`` multiplies them
        with the same C++ kernel (GGML blocks, fp8) and no bias: a decode step then runs every layer in one call,
        to the same bits.

        Args:
            params: what ``prepare`` (or ``prepare_packed``) returned.

        Returns:
            The weights, or None (the default): such layers run layer by layer.
        """
        return None

    @abstractmethod
    def linear(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        """``x @ weight.T (+ bias)``.

        Args:
            x: ``[num_tokens, in_features]`` in the model dtype.
            params: what ``prepare`` returned.

        Returns:
            ``[num_tokens, out_features]`` in the model dtype.
        """

    def num_bytes(self, params: Params) -> int:
        """Bytes the stored tensors occupy.

        Args:
            params: what ``prepare`` (or ``prepare_packed``) returned.

        Returns:
            The sum over the tensors (the default), for the banner and /metrics.
        """
        return sum(t.numel() * t.element_size() for t in params.values())

    def formats(self, params: Params) -> dict[str, int]:
        """The bytes of one layer's params by the format they are kept in (the banner and /metrics say it);
        "copies" for second copies that a step reads instead of the first.

        Args:
            params: what ``prepare`` (or ``prepare_packed``) returned.

        Returns:
            Bytes by format name; the default: ``{self.name: self.num_bytes(params)}``.
        """
        return {self.name: self.num_bytes(params)}
