"""C++ kernels for CPUs (``csrc/``): paged attention (decode; prefill where the CPU has AVX-512 BF16),
the fused element-wise layers, and linear layers over bf16 weights, over GGUF's quantized blocks and over fp8 weights.

They are built with torch's extension builder for the CPU this runs on, the
first time they are needed (about a minute on two idle cores, a line as each source compiles; ``make setup`` does
it ahead), and kept
in a cache directory under a name that carries the sources, the flags, the
CPU's feature flags and the checkout's and environment's paths, so a change of
any of them builds afresh and two checkouts never rebuild each other's. Where they
cannot be built (no C++ compiler), everything falls back to torch ops and a
warning says so once.

    python -m conveyor.native   # build now (``make setup`` runs this)

The cache directory is ``$CONVEYOR_CACHE_DIR/kernels`` (default ``~/.cache/conveyor/kernels``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

from conveyor.native.build_progress import BUILD_TIME, BuildProgress
from conveyor.config.paths import cache_root

logger = logging.getLogger("conveyor")

CSRC = Path(__file__).resolve().parent / "csrc"
# the largest first: the build runs a few compilers at once, and the longest one started last would finish alone
SOURCES = sorted(CSRC.glob("*.cpp"), key=lambda source: (-source.stat().st_size, source.name))
# -march=native: the build is for this CPU (its feature flags are part of the cache name).
# -fopenmp: ATen's parallel_for is OpenMP in headers and runs on one thread without it; the
# extension then shares torch's OpenMP runtime (same soname, already loaded) rather than a second one.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_loaded: bool | None = None


def build_name(csrc: Path = CSRC, prefix: str = sys.prefix) -> str:
    """The build's directory name under ``cache_dir()``: a digest of the sources in ``csrc``, the flags, torch,
    the CPU's feature flags, and where the sources and the environment (``prefix``) are. torch's builder writes
    absolute paths into its build files, so two checkouts, or two environments, that shared one directory would
    rebuild it each time the other loaded."""
    digest = hashlib.sha1()
    for source in sorted(csrc.glob("*.[ch]*")):
        digest.update(source.read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS + [torch.__version__, platform.machine()]).encode())
    digest.update(f"{csrc.resolve()}\0{Path(prefix).resolve()}".encode())
    try:
        digest.update(next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "Features"))
        ).encode())
    except (OSError, StopIteration):
        digest.update(platform.processor().encode())
    return f"conveyor_cpu_{digest.hexdigest()[:12]}"


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _put_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the ninja wheel's binary sits in the environment's bin/,
    which is not on PATH when the environment's python runs without being activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


# a build lock older than this was left by a build that died (killed, or its machine stopped): builds take
# seconds to a few minutes, and torch's builder would wait for the lock's owner forever
STALE_LOCK_S = 900


def clear_stale_lock(build_dir: Path) -> bool:
    """Remove the build directory's lock if a build that died left it; True if it did."""
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime < STALE_LOCK_S:
            return False
        lock.unlink()
    except FileNotFoundError:
        return False
    logger.warning("removed %s, left by a kernel build that did not finish", lock)
    return True


def load() -> bool:
    """Build (if needed) and load the kernels; False where they cannot be built."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        from torch.utils import cpp_extension

        name = build_name()
        build_dir = cache_dir() / name
        started = time.perf_counter()
        progress = None
        if not (build_dir / f"{name}.so").exists():
            logger.info("building the CPU kernels for this machine (once: %s) in %s", BUILD_TIME, build_dir)
            progress = BuildProgress(build_dir, SOURCES)
        try:
            build_dir.mkdir(parents=True, exist_ok=True)
            clear_stale_lock(build_dir)
            _put_ninja_on_path()
            # (copies of the flags: the builder appends to the lists it is given, which would change the name)
            cpp_extension.load(
                name, [str(s) for s in SOURCES], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                build_directory=str(build_dir), is_python_module=False, verbose=False,
            )
        except Exception as e:  # noqa: BLE001 -- no compiler, no ninja, a failed build: the torch ops still work
            if progress is not None:
                progress.stop()
            message = str(e).strip().splitlines()
            logger.warning("CPU kernels unavailable (%s: %s); using torch ops instead",
                           type(e).__name__, message[-1] if message else "")
            _loaded = False
            return False
        if progress is not None:
            progress.stop()
            logger.info("CPU kernels built in %.0f s", time.perf_counter() - started)
        logger.debug("CPU kernels loaded in %.1f s", time.perf_counter() - started)
        _register_fakes()
        _loaded = True
        return True


def _register_fakes() -> None:
    """Shapes of the in-place element-wise kernels for torch.compile (they return nothing; their outputs
    are the tensors they write), so a compiled graph holds them without a break."""
    for name in ("rms_norm", "silu_mul", "rotary_"):
        torch.library.register_fake(f"conveyor_cpu::{name}", lambda *args: None)


def _ops():
    if _loaded:  # (a plain read first: torch.compile traces through this)
        return torch.ops.conveyor_cpu
    if not load():
        raise RuntimeError("the CPU kernels could not be built on this machine (see the warning above)")
    return torch.ops.conveyor_cpu


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of one query per sequence over its paged keys and values, read in place.

    Args:
        q: ``[B, Hq, D]``.
        k_cache, v_cache: ``[Hkv, slots, D]`` (float32, bfloat16, float16, or uint8 e4m3 bits with scales);
            slot = block * block_size + offset.
        block_tables: ``[B, max_blocks]`` int32 block ids (entries past a sequence's length are never read).
        context_lens: ``[B]`` int32 keys per sequence.
        k_scale, v_scale: ``[Hkv, slots]`` bfloat16 per-token scales of an fp8 cache.
        out: ``[B, Hq, D]`` to write into (a new tensor if None).
        scale: what scores are multiplied by (None: ``D ** -0.5``).
        window: keys each query sees, its own included: the last ``window`` (0: all).
        softcap: scores become ``softcap * tanh(score / softcap)`` before the softmax (0: not capped).

    Returns:
        ``[B, Hq, D]`` in q's dtype.
    """
    ops = _ops()
    if out is None:
        out = torch.empty_like(q)
    ops.paged_decode_attention(
        q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, block_size,
        q.shape[-1] ** -0.5 if scale is None else scale, window, softcap, out,
    )
    return out


def prefill_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``paged_prefill_attention`` runs for these dtypes and head size on this CPU."""
    return bool(_ops().paged_prefill_supported(q, k_cache))


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_rows: torch.Tensor,
    q_lens: torch.Tensor,
    starts: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of prompt chunks over their paged keys and values (the chunks' own K, V already stored).

    Args:
        q: ``[T, Hq, D]`` bfloat16; chunk i is rows ``q_rows[i] .. q_rows[i] + q_lens[i] - 1``.
        k_cache, v_cache: ``[Hkv, slots, D]`` bfloat16.
        block_tables: ``[S, max_blocks]`` int32, one row per chunk.
        q_rows, q_lens, starts: ``[S]`` int32: first row, length, and position of the first query
            (the tokens already cached before the chunk).
        out: ``[T, Hq, D]``; only the chunks' rows are written.
        scale: what scores are multiplied by (None: ``D ** -0.5``).
    """
    _ops().paged_prefill_attention(
        q, k_cache, v_cache, block_tables, q_rows, q_lens, starts, block_size,
        q.shape[-1] ** -0.5 if scale is None else scale, out,
    )
    return out


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * norm(h)`` (``[T, hidden]``); with ``delta``, first ``h += delta`` in place (the residual add)."""
    out = torch.empty_like(h)
    _ops().rms_norm(h, delta, weight, eps, out)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` (``[T, 2 I]`` -> ``[T, I]``)."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    _ops().silu_mul(gate_up, out)
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` in place (half-split layout) by ``cos``, ``sin`` ``[T, head_dim / 2]``."""
    _ops().rotary_(x, cos, sin)
    return x



def gemv_supported() -> bool:
    """Whether ``gemv_bf16`` runs on this CPU (AVX-512 BF16)."""
    return load() and bool(torch.ops.conveyor_cpu.gemv_supported())


def gemv_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for one token: ``x [1, K]``, ``weight [N, K]`` row-major, all bfloat16."""
    out = x.new_empty(1, weight.shape[0])
    _ops().gemv_bf16(x, weight, bias, out)
    return out


def tile_linear_supported() -> bool:
    """Whether ``tile_linear`` runs on this CPU (AMX-BF16, granted by the operating system)."""
    return load() and bool(torch.ops.conveyor_cpu.tile_linear_supported())


def tile_linear(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [M, K]``, 1 <= M <= 64, against ``tiles``, the weight as
    ``conveyor.model.formats.decode_copy("tiles", weight)`` lays it out; bfloat16."""
    out = x.new_empty(x.shape[0], tiles.shape[0] * 16)
    _ops().tile_linear(x, tiles, bias, out)
    return out


_ggml_path: str | None = None


def int8_peak_ops(path: str, iterations: int) -> int:
    """Run the int8 dot products of ``path`` ("scalar", "avx2", "avx512_vnni", "amx") in registers on every
    thread, ``iterations`` turns each; the operations done in all (time it for the peak: csrc/int8_peak.cpp)."""
    return int(_ops().int8_peak_ops(path, iterations))


def ggml_linear_path() -> str:
    """The fastest path of ``ggml_linear`` built here: "amx", "avx512_vnni", "avx2", or "scalar" (any CPU); each
    includes the ones before it."""
    global _ggml_path
    if _ggml_path is None:
        _ggml_path = str(_ops().ggml_linear_path())
    return _ggml_path


def ggml_linear(x: torch.Tensor, weight: torch.Tensor, type_id: int, bias: torch.Tensor | None = None,
                path: str | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for ``x [M, K]`` (float32, bfloat16 or float16) against ``weight``, a
    ``uint8 [N, row_bytes]`` of GGML blocks of type ``conveyor.model.ggml.TYPE_IDS[...]``; x is quantized per
    32 values to int8 inside (as llama.cpp does; Q8_0R, one scale a row, per 64 in AMX steps of 16 rows or more
    where K is a multiple of 64). ``path`` forces a slower path (``ggml_linear_path``; None: the
    fastest)."""
    out = x.new_empty(x.shape[0], weight.shape[0])
    _ops().ggml_linear(x.contiguous(), weight, type_id, bias, out, path or ggml_linear_path())
    return out


def amx_min_rows() -> int:
    """The fewest rows a step needs for ``ggml_linear``'s AMX panels, where its path is "amx" (fewer: VNNI);
    ``conveyor.native.gemm_choice`` sets it by timing both."""
    return int(_ops().ggml_amx_min_rows())


def set_amx_min_rows(rows: int) -> None:
    _ops().ggml_set_amx_min_rows(rows)


def fp8_upcast(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (float8 e4m3 ``[N, K]``) times ``scale`` (float32 ``[N]``) in ``dtype``, bit for bit as torch
    computes ``weight.to(dtype) * scale[:, None].to(dtype)``, in one vectorized pass."""
    out = torch.empty(weight.shape, dtype=dtype)
    _ops().fp8_upcast(weight, scale, out)
    return out


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """``k_cache[:, slot_mapping] = k.transpose(0, 1)`` and the same for v: caches ``[Hkv, slots, D]``,
    ``k``, ``v`` ``[T, Hkv, D]`` (unit stride along D), ``slot_mapping`` int64 ``[T]``."""
    _ops().store_kv(k_cache, v_cache, slot_mapping, k, v)


def decode_layers(h: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  weights: list[torch.Tensor], types: list[int], scales: list[torch.Tensor], norms: list[torch.Tensor],
                  eps: float, softmax_scale: float, block_size: int, num_heads: int) -> torch.Tensor:
    """Every layer of a decode step of Llama's plain block over GGML block or fp8 weights, in one call: the final
    norm's output ``[M, hidden]`` for the embedded tokens ``h`` (each sequence's one new token), the layers' keys
    and values stored at ``slot_mapping`` in ``k_cache``, ``v_cache`` ``[layers, kv_heads, slots, head_dim]``.

    ``weights``, ``types``, ``scales``: per layer qkv, o_proj, gate_up and down, as ``ggml_linear`` takes them
    (an empty scale), or fp8 as ``fp8_linear`` does (type ``conveyor.quant.FP8_TYPE_ID``); ``norms``: per
    layer the input and post-attention norms' weights, then the final norm's; ``cos``, ``sin``: ``[M, head_dim /
    2]``. The same kernels as the layer-by-layer path, in the same order: the same result, bit for bit."""
    out = torch.empty_like(h)
    _ops().decode_layers(h, k_cache, v_cache, slot_mapping, block_tables, context_lens, cos, sin, weights, types,
                         scales, norms, eps, softmax_scale, block_size, num_heads, out)
    return out


def fp8_linear_supported() -> bool:
    """Whether ``fp8_linear`` runs on this CPU (AVX2, FMA and F16C)."""
    return load() and bool(torch.ops.conveyor_cpu.fp8_linear_supported())


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T (+ bias)`` for ``x [M, K]`` (float32, bfloat16 or float16), ``weight``
    float8 e4m3 ``[N, K]`` and ``scale`` float32 ``[N]``, the weight converted in registers."""
    out = x.new_empty(x.shape[0], weight.shape[0])
    _ops().fp8_linear(x.contiguous(), weight, scale, bias, out)
    return out
