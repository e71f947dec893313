"""From how many rows ``ggml_linear``'s AMX panels take a step, chosen by timing them against the VNNI panels.

On a CPU with AMX-INT8 (Intel since Sapphire Rapids) a step of many rows over packed blocks has two batched
products: AMX tiles (TDPBSUD, 16 rows x 16 columns x 64 bytes an instruction, but every 32-value sub-block's
sums leave the tile to be scaled) and AVX-512 VNNI panels (VPDPBUSD). Which is the faster, and from how many
rows, depends on the CPU, its memory and the layer: on a 2-core Xeon the AMX panels won from 32 rows before
either fetched its weights ahead, and by little (45.1 against 46.6 ms for SmolLM2's layers at 64 rows). So a
worker on such a CPU times both on one of its own layers at load, and AMX runs from the fewest rows at which it
was the faster at every count timed above them too; nowhere, where it never was. Elsewhere there is nothing to
choose. (Both paths give a row the same bits, tests/test_ggml.py: the choice moves no token.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from conveyor import native
from conveyor.model import ggml
from conveyor.quant import NativeWeight

logger = logging.getLogger("conveyor.native")

# step sizes timed (a batched decode to a prompt chunk), and the runs of each path taken at each (the fastest
# counts: another process on the cores slows a run, never speeds one)
ROWS = (32, 64, 128, 256)
REPEATS = 3
NEVER = 1 << 40  # (amx_min_rows where AMX should take no step)


def amx_from(times: dict[int, tuple[float, float]]) -> int | None:
    """The fewest rows from which AMX was the faster at every count timed (``times``: rows -> (AMX seconds, VNNI
    seconds)); None where it lost at the most rows timed."""
    start = None
    for rows in sorted(times, reverse=True):
        amx, vnni = times[rows]
        if amx > vnni:
            break
        start = rows
    return start


def _fastest(weight: NativeWeight, x: torch.Tensor, path: str) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        native.ggml_linear(x, weight.weight, weight.type_id, path=path)
        best = min(best, time.perf_counter() - start)
    return best


def choose_amx_rows(weights: Iterable[NativeWeight]) -> int | None:
    """On a CPU whose fastest path is AMX, time it against VNNI on the largest of ``weights`` (packed blocks of a
    type AMX takes) at each of ROWS, and set the rows from which AMX runs; the rows set (NEVER where AMX lost),
    or None where there was nothing to choose."""
    if not native.load() or native.ggml_linear_path() != "amx":
        return None
    names = {number: name for name, number in ggml.TYPE_IDS.items()}
    # (Q6_K has no AMX path: two scales a sub-block; Q8_0R its own, run_rows_gemm)
    blocks = [w for w in weights if w.scale is None and names.get(w.type_id, "Q6_K") not in ("Q6_K", "Q8_0R")]
    if not blocks:
        return None
    weight = max(blocks, key=lambda w: w.weight.numel())
    values, size = ggml.BLOCKS[names[weight.type_id]]
    in_features = weight.weight.shape[1] // size * values
    times = {}
    for rows in ROWS:
        x = torch.randn(rows, in_features, dtype=torch.bfloat16)
        native.ggml_linear(x, weight.weight, weight.type_id, path="amx")  # (the tiles' configuration, the cache)
        native.ggml_linear(x, weight.weight, weight.type_id, path="avx512_vnni")
        times[rows] = (_fastest(weight, x, "amx"), _fastest(weight, x, "avx512_vnni"))
    start = amx_from(times)
    native.set_amx_min_rows(NEVER if start is None else start)
    timed = ", ".join(f"{rows}: {amx * 1e3:.2f} / {vnni * 1e3:.2f}" for rows, (amx, vnni) in times.items())
    logger.info("packed-block products: AMX panels %s (ms by rows, AMX / VNNI, a %d x %d layer: %s)",
                f"from {start} rows" if start is not None else "never faster: VNNI panels throughout",
                weight.weight.shape[0], in_features, timed)
    return NEVER if start is None else start
