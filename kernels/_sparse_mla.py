"""Sparse-MLA decode (DeepSeek-V3.2 DSA, absorbed "MQA mode") in Triton: split-K flash-decoding over the top-k rows.

One program handles (query row t, a block of BLOCK_H heads, split s of the valid top-k positions). It gathers
each selected latent row once for all its heads (MQA reuse), computes QKᵀ with tensor-core ``tl.dot`` on four
128-lane chunks of c_kv plus the 64 rope lanes, runs an online softmax in base 2, and accumulates PV with
``tl.dot`` reusing the same four chunks as V (V = first 512 lanes of the row). With S > 1 splits, each split
writes a normalised partial output and its LSE, and ``_combine_kernel`` merges them (flash-decoding LSE merge).
Splits are what let one or a few query rows fill the 132 SMs of an H200 (2048 rows / 64-row tiles = 32 tiles).
With ``DecodeConfig.pdl`` the two kernels are programmatic dependent launches (``_gdc``), so the merge's launch
overlaps the split kernel; with ``DecodeConfig.merge`` (warp-specialised Gluon kernels only) the split programs meet
at a grid barrier and merge their own partials, one launch in all. The build times both settings per shape.

In Gluon kernels 1–3 and the ``tl.dot`` kernel (unless ``DecodeConfig.fold``), FP8 656-byte rows are never
dequantised element-wise with their scales: for chunk g the per-token scale ``sc_g[n]`` multiplies the score tile
after the dot (``s += sc_g[None, :] · (q_g · k8_gᵀ)``) and the probabilities before the PV dot
(``acc_g += (p · sc_g[None, :]) · k8_g``); the e4m3 → bf16 conversion feeding the MMA is the only per-element work.
That is exact algebra, and with ue8m0 (power-of-two) scales it even rounds the same. With ``fold`` the ``tl.dot``
kernel dequantises each gathered chunk to bf16(x · sc_g) instead and runs the bf16 cache's dot chains. The
warp-specialised Gluon kernels (4, 5, 7) stage each tile once in bf16 with the scale folded in, as FlashMLA's sm90 sparse decode does:
bf16(bf16(x) · bf16(scale)) (``cvt_fp8x8_bf16x8``, FlashMLA csrc/sm90/decode/sparse_fp8/components/dequant.h).

Masked entries (index −1, or position ≥ topk_length[t]) score −inf; the running max starts at the finite
sentinel −1e30 so an all-masked tile never computes (−inf) − (−inf) (the guard vLLM/SGLang Triton MLA kernels
use). Empty rows give o = 0, lse = +inf (FlashMLA convention). Structure follows vLLM
``vllm/v1/attention/ops/triton_sparse_mla_kernel.py`` (grid, split count, merge) and the spec §4.5.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["WS_HEAD_BLOCKS", "DecodeConfig", "check_decode_config", "default_decode_config", "set_decode_configs",
           "sparse_decode_v4", "sparse_mla_decode"]

D_QK = 576
D_V = 512
_MAX_SPLITS = 64


@dataclass(frozen=True)
class DecodeConfig:
    """Launch configuration of the decode kernel; ``splits`` in [1, 64] (1 = no combine pass)."""

    block_h: int = 16
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    splits: int = 1
    prefetch: int = 0
    """0: plain loop. 1: load the next tile's KV into registers while computing this one (hand-rolled double
    buffering). 2 (FP8 only): convert one 128-lane chunk at a time and re-read it for PV (register-lean)."""
    fold: int = 0
    """FP8 KV, ``tl.dot`` kernel with prefetch 0 or 1: 1 = dequantise each gathered row chunk as bf16(x · scale), the
    product in fp32, and run the bf16 cache's dot chains; 0 = apply the scales to the score tile and to p instead."""
    mma_f16: int = 0
    """FP8 KV only, experimental: fp16 instead of q's bf16 as the MMA operand type (needs |q|, |k_pe| < 65504;
    not chosen by ``build_and_verify``)."""
    qk_chains: int = 0
    """``tl.dot`` kernel (gluon 0) with prefetch 0 or 1, bf16 cache or FP8 ``fold``: 1 = QKᵀ as five independent MMA
    chains (the 64 rope lanes and each 128-lane chunk, each scaled, then summed), 0 = one accumulator chain over all
    576 lanes. With a 16-head block and 32-row tiles each warp holds one m16n8 score tile, so the single chain is
    36 dependent ``mma.sync`` deep (SASS of Triton 3.6 for sm_90a); split, ptxas interleaves them. (The FP8 path
    without ``fold`` scales each chunk's scores and is already split.)"""
    gluon: int = 0
    """FP8 KV on sm_90 only: the Gluon tokens-as-M wgmma kernels (``_sparse_mla_gluon``; 64-token tiles;
    block_n, num_warps, num_stages and prefetch are ignored). 1–3 (block_h 16 or 32, 4 warps): 1: two cp.async
    stages, 2: one stage, 3: rows loaded straight into registers (no staging, two programs per SM). 4, 5 and 7: the
    warp-specialised kernel (loader warps gather and dequantise into two bf16 stages while an MMA warpgroup
    computes; one program per SM): 4: two loader partitions, block_h 16 or 32; 5: one loader partition,
    block_h 16, 32 or 64 (64: two MMA warpgroups, each half of the heads); 7: block_h 64 with heads as wgmma's M
    (``_ws_mma_hm``: one MMA partition computes QKᵀ, the softmax and half of the output lanes, and hands P to a
    second for the other half)."""
    pdl: int = 0
    """Programmatic dependent launch (sm_90+, Triton 3.3+; ``pdctl.kernels._gdc``): 0: plain launches. 1 and 2:
    both kernels launched with PDL, each waiting for the previous kernel in the stream before touching memory;
    the split kernel lets the merge launch at its start (1) or after its main loop (2). Same results; which is
    faster depends on the shape (``build_and_verify`` times them)."""

    bf16_partials: int = 0
    """splits > 1: 1 = each split's normalised partial output is stored in bf16 instead of fp32 (half the bytes the
    split kernel writes and the merge reads; the merge still weighs and sums them in fp32); 0 = fp32."""
    merge: int = 0
    """Warp-specialised Gluon kernels (``gluon`` 4, 5, 7) with splits > 1 only: 1 = the split programs merge their own
    partials after a grid-wide barrier (``_sparse_mla_gluon._grid_barrier``), one launch instead of the split
    kernel and ``_combine_kernel``. The whole grid must be resident at once, so the kernel is launched
    cooperatively (CUDA's cooperative launch attribute, Triton's ``launch_cooperative_grid``) and the grid
    (rows × head blocks × splits) must not exceed the SM count; sparse_mla_decode raises ValueError otherwise."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


LAST_LAUNCH: dict[str, Any] = {}
"""Registers and spills of the last compiled decode launch (for the benchmark's notes)."""

_TUNED: dict[tuple[int, str, int], DecodeConfig] = {}
"""Configs chosen by ``build_and_verify`` keyed by (heads, kv format, rows T); filled from the manifest."""


def set_decode_configs(table: dict[tuple[int, str, int], DecodeConfig]) -> None:
    """Install tuned configs (used by ``load_manifest`` and ``build_and_verify``)."""
    _TUNED.update(table)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def default_decode_config(heads: int, rows: int, kv_format: str, num_sms: int = 132, topk: int = 2048) -> DecodeConfig:
    """Heuristic config: 16-head blocks up to 32 heads, 32 above; enough splits for ~1 wave of programs.

    A tuned entry for exactly (heads, kv_format, rows) wins when ``build_and_verify`` has installed one.
    """
    tuned = _TUNED.get((heads, kv_format, rows))
    if tuned is not None:
        return tuned
    block_h = 16 if heads <= 32 else 32
    block_n = 32 if kv_format == "v4" else 64  # V4: a [rows, 512] bf16 tile per step (+ 64 rope lanes)
    programs = rows * -(-heads // block_h)
    splits = _next_pow2(-(-num_sms // max(programs, 1)))
    splits = max(1, min(splits, _MAX_SPLITS, max(1, topk // block_n)))
    return DecodeConfig(block_h=block_h, block_n=block_n, num_warps=4, num_stages=2, splits=splits)


@functools.cache
def _kernels() -> tuple[Any, Any]:
    from pdctl.kernels import _sparse_mla_kernels as k

    return k._sparse_mla_decode_kernel, k._combine_kernel


@functools.cache
def _v4_kernel() -> Any:
    from pdctl.kernels import _sparse_mla_kernels as k

    return k._sparse_decode_v4_kernel


@functools.cache
def _gluon_kernel() -> Any:
    from pdctl.kernels import _sparse_mla_gluon as g

    return g._decode_fp8_tm_kernel


@functools.cache
def _gluon_ws_kernel() -> Any:
    from pdctl.kernels import _sparse_mla_gluon as g

    return g._decode_fp8_ws_kernel


WS_HEAD_BLOCKS = {4: (16, 32), 5: (16, 32, 64), 7: (64,)}
"""The warp-specialised Gluon variants (``DecodeConfig.gluon``) and the head blocks each one runs; 1–3 run 16 and 32."""


def _ws_launch(variant: int, block_h: int, splits: int) -> dict[str, int | bool]:
    """Warps and register split of the warp-specialised kernel: the MMA partition's warps (``num_warps``), the
    loaders' register budget, and ``maxnreg`` so that one program's warps fit the SM's 64K registers (all checked
    spill-free or nearly with ``ptxas -v`` for sm_90a, Triton 3.6); and ``EVICT_FIRST``, the loaders' cache hint
    for the gathered rows, set for splits ≤ 2 (long per-program loops): measured on the H200 (2026-11-30, top-k
    2048, so 16–32 tiles a program) 1–3 % faster at B = 64 (h = 16, 64, 128; splits 1–2), no change at h = 128,
    B = 8 (8 splits), 8–11 % slower at B = 1 (16–32 splits, 1–2 tiles a program)."""
    hint = {"EVICT_FIRST": splits <= 2}
    if variant == 4:
        return {"LOADERS": 2, "LOADER_WARPS": 4, "LOADER_REGS": 128, "num_warps": 4, "maxnreg": 168, **hint}
    if variant == 7:  # launched at 168 registers × 384 threads; then QKᵀ + softmax 224, the PV partition 160, loader 120
        return {"LOADERS": 1, "HM": True, "MMA_REGS": 160, "LOADER_WARPS": 4, "LOADER_REGS": 120, "num_warps": 4,
                "maxnreg": 168, **hint}
    if block_h == 64:
        return {"LOADERS": 1, "LOADER_WARPS": 4, "LOADER_REGS": 120, "num_warps": 8, "maxnreg": 168, **hint}
    return {"LOADERS": 1, "LOADER_WARPS": 4, "LOADER_REGS": 168, "num_warps": 4, "maxnreg": 248, **hint}


def gluon_available(device: torch.device | None = None) -> bool:
    """True when the Gluon FP8 kernel can run here: a Hopper (sm_90) GPU and a Triton that ships Gluon."""
    import torch

    if not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    try:
        _gluon_kernel()
    except Exception:
        return False
    return True


@functools.cache
def _pdl_supported(device: torch.device) -> bool:
    """True when decode launches can use programmatic dependent launch: an sm_90+ GPU (PTX ``griddepcontrol``)
    and a Triton whose launcher takes ``launch_pdl`` (3.3+; ``triton.backends.nvidia.compiler.CUDAOptions``)."""
    import torch

    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def _pdl_launch(x: torch.Tensor, mode: int) -> dict[str, int | bool]:
    """Launch keywords for a kernel taking the ``GDC`` constexpr (``pdctl.kernels._gdc``): mode 1 or 2 with the
    PDL launch attribute when asked for and supported on ``x``'s device; plain launches (``GDC`` 0) otherwise,
    including on the CPU interpreter. Raises ValueError for a mode outside 0–2."""
    if mode not in (0, 1, 2):
        raise ValueError(f"pdl must be 0 (plain launches), 1 or 2 (programmatic dependent launch), got {mode}")
    if mode and x.is_cuda and _pdl_supported(x.device):
        return {"GDC": mode, "launch_pdl": True}
    return {"GDC": 0}


_BARRIER_POOL: dict[int, torch.Tensor] = {}
"""Per device: ``int32 [64 · 32]``, zeroed outside any CUDA-graph capture; counter i is element 32·i (one 128-byte
line each)."""
_BARRIER_SLOTS: dict[tuple[int, int], int] = {}
_BARRIER_COUNTERS = 64


def _grid_barrier_counter(x: torch.Tensor) -> torch.Tensor:
    """The ``int32 [1]`` counter that a ``merge = 1`` launch on ``x``'s device and the current stream synchronises on.

    The barrier (``_sparse_mla_gluon._grid_barrier``) needs the counter's low 31 bits at 0 when a grid arrives, and
    leaves them at 0 after every complete barrier; so each counter is zeroed once, at the first ``merge = 1`` call
    on the device, which must not be inside a CUDA-graph capture (a zeroing recorded in one graph would not cover
    another graph captured on the same stream, nor calls before that graph's first replay). One counter per
    (device, stream): launches on one stream reach the barrier one grid at a time (with programmatic dependent launch
    the next grid's programs wait for this grid to complete before they touch memory). Graphs captured on one
    stream share its counter, so they must not be replayed concurrently on different streams.

    Raises:
        RuntimeError: the first ``merge = 1`` call on a device is inside a CUDA-graph capture (warm up eagerly first,
            as SGLang's graph runner does), or more than 64 streams on one device used ``merge = 1``.
    """
    import torch

    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    pool = _BARRIER_POOL.get(dev)
    if pool is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("DecodeConfig.merge=1: the grid-barrier counters are zeroed by the first merge=1 call on "
                               f"cuda:{dev}, which must run outside CUDA-graph capture; make one eager (warm-up) call "
                               "before capturing")
        pool = torch.zeros(_BARRIER_COUNTERS * 32, dtype=torch.int32, device=x.device)
        torch.cuda.synchronize(x.device)  # zero before any stream (or a capture) can use it
        _BARRIER_POOL[dev] = pool
    key = (dev, torch.cuda.current_stream(x.device).cuda_stream)
    slot = _BARRIER_SLOTS.get(key)
    if slot is None:
        slot = sum(1 for d, _ in _BARRIER_SLOTS if d == dev)
        if slot >= _BARRIER_COUNTERS:
            raise RuntimeError(f"DecodeConfig.merge=1 on more than {_BARRIER_COUNTERS} streams of cuda:{dev}")
        _BARRIER_SLOTS[key] = slot
    return pool[32 * slot: 32 * slot + 1]


def check_decode_config(cfg: DecodeConfig, heads: int, rows: int, kv_format: str, num_sms: int | None) -> None:
    """Refuse a launch config that cannot run ``rows`` query rows of ``heads`` heads on a ``kv_format`` cache
    (``"fp8"`` or ``"bf16"``) on a GPU with ``num_sms`` SMs (``None``: not checked): the split count, the Gluon
    variants' cache format and head blocks, and the in-kernel merge's conditions. Used by
    :func:`sparse_mla_decode` before anything is allocated or launched, and by ``load_manifest`` before a tuned
    table is installed. (q's dtype and the PDL mode are checked at launch.)

    Raises:
        ValueError: naming the field and what it must be.
    """
    if not 1 <= cfg.splits <= _MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {_MAX_SPLITS}], got {cfg.splits}")
    if kv_format == "v4":
        # DeepSeek-V4's kernel (_sparse_decode_v4_kernel) has the launch settings of the V3.2 tl.dot kernel's plain
        # loop only: block sizes, warps, stages, splits, PDL and bf16 partials.
        extra = {k: getattr(cfg, k) for k in ("prefetch", "fold", "mma_f16", "qk_chains", "gluon", "merge")
                 if getattr(cfg, k)}
        if extra or cfg.block_h not in (16, 32, 64) or cfg.block_n not in (16, 32, 64):
            raise ValueError(f"the V4 decode kernel takes block_h 16, 32 or 64, block_n 16, 32 or 64 and none of "
                             f"{sorted(extra) or 'prefetch/fold/mma_f16/qk_chains/gluon/merge'}, got {cfg}")
        if cfg.bf16_partials not in (0, 1) or (cfg.bf16_partials and cfg.splits < 2):
            raise ValueError(f"bf16_partials must be 0 or 1, and 1 only with splits > 1, got {cfg}")
        return
    if cfg.fold not in (0, 1) or (cfg.fold and (kv_format != "fp8" or cfg.gluon or cfg.prefetch not in (0, 1)
                                                 or cfg.mma_f16)):
        raise ValueError(f"fold=1 is a setting of the tl.dot kernel (gluon 0) on the FP8 cache with prefetch 0 or 1 "
                         f"and bf16 MMA operands (mma_f16 0), got {cfg} for a {kv_format} cache")
    if cfg.qk_chains not in (0, 1) or (cfg.qk_chains and (cfg.gluon or cfg.prefetch not in (0, 1)
                                                          or (kv_format == "fp8" and not cfg.fold))):
        raise ValueError(f"qk_chains=1 is a setting of the tl.dot kernel (gluon 0) with prefetch 0 or 1 on the bf16 "
                         f"cache or the FP8 cache with fold=1, got {cfg} for a {kv_format} cache")
    if cfg.bf16_partials not in (0, 1) or (cfg.bf16_partials and cfg.splits < 2):
        raise ValueError(f"bf16_partials must be 0 or 1, and 1 only with splits > 1 (the partials a merge reads), "
                         f"got {cfg}")
    if cfg.merge not in (0, 1):
        raise ValueError(f"merge must be 0 (separate merge kernel) or 1 (merged in the split kernel), got {cfg.merge}")
    if cfg.gluon in WS_HEAD_BLOCKS:
        if kv_format != "fp8" or cfg.block_h not in WS_HEAD_BLOCKS[cfg.gluon]:
            raise ValueError(f"the warp-specialised Gluon kernel needs the FP8 cache, bf16 q and block_h 16 or 32 "
                             f"(gluon 4), 16, 32 or 64 (gluon 5) or 64 (gluon 7), got {cfg}")
    elif cfg.gluon and (kv_format != "fp8" or cfg.block_h not in (16, 32) or cfg.gluon not in (1, 2, 3)):
        raise ValueError(f"the Gluon kernel needs the FP8 cache, bf16 q, block_h 16 or 32 and gluon 1-5 or 7, "
                         f"got {cfg}")
    if cfg.merge:
        if cfg.gluon not in WS_HEAD_BLOCKS:
            raise ValueError(f"merge=1 is a setting of the warp-specialised Gluon kernels (gluon 4, 5 or 7), "
                             f"got {cfg}")
        programs = rows * -(-heads // cfg.block_h) * cfg.splits
        if cfg.splits < 2 or (num_sms is not None and programs > num_sms):
            raise ValueError(f"merge=1 needs splits > 1 and at most one program per SM (rows × head blocks × "
                             f"splits = {programs} here, {num_sms} SMs): use merge=0 for {cfg}")


def _combine_block_d(row_heads: int, num_sms: int) -> int:
    """Lanes of the 512-wide output one combine program merges: all 512 once (rows × heads) fills two
    waves of SMs, else fewer (down to 32) so that small batches still spread over the GPU."""
    block_d = D_V
    while block_d > 32 and row_heads * (D_V // block_d) < 2 * num_sms:
        block_d //= 2
    return block_d


def _combine_warps(block_s: int, block_d: int, bf16_partials: bool = False) -> int:
    """Warps of one combine program: 1 for a [splits, lanes] tile of at most 2048 values (4096 with bf16 partials),
    else 4. The merge is a chain of dependent loads and reductions; one warp reduces over the splits with shuffles
    alone, where four meet in shared memory behind barriers. Measured on the H200 (CUDA-graph replays, whole decode
    call, ``kernels/RESULTS.md``): with 32-lane blocks it took h = 16, B = 1 from 7.27 to 6.9 µs, h = 32, B = 1 from
    7.84 to 7.3, h = 128, B = 1 (16 splits) from 16.0 to 11.9, h = 16, B = 8 from 14.6 to 12.0 (2026-11-30); with
    4096-value tiles of fp32 partials (h ≥ 64, B = 8) one warp was 0.3–2.1 µs slower, but with bf16 partials four
    warps were the slow choice: gluon-5 32,8 at h = 64, B = 8 23.2 µs plain and 30.1 with PDL against 21.1 and 22.2
    with one warp; gluon-7 64,8 at h = 128, B = 8 34.3 / 38.2 against 30.1 / 30.9 (2026-12-01,
    ``benchmarks/partials_probe.py``)."""
    return 1 if block_s * block_d <= (4096 if bf16_partials else 2048) else 4


def _num_sms(device: torch.device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def sparse_mla_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse-MLA decode: ``o = softmax(q·Kᵀ·sm_scale) · V`` over the selected latent rows.

    Args:
        q: absorbed queries ``[T, h, 576]``, bf16 on a GPU (fp16/fp32 also accepted: the CPU interpreter tests
            use them because Triton's interpreter computes bf16 ``tl.dot`` wrongly). 8 ≤ h ≤ 128 is what the
            deployment uses; any h ≥ 1 works (heads are masked up to BLOCK_H).
        kv: latent cache, either ``[slots, 576]`` in q's float dtype (the bf16 layout; a ``[slots, 1, 576]`` view
            is accepted) or the FP8 layout ``uint8 [slots, 656]`` (also ``[pages, 64, 656]`` / ``[.., 1, 656]``
            views). Rows are gathered directly: no block table.
        indices: physical slots ``int32 [T, K]``; −1 = invalid. K is 2048 in DeepSeek-V3.2.
        sm_scale: softmax scale (e.g. 0.135234 for V3.2; FlashMLA's 576^-0.5 default is *wrong* for it).
        topk_length: optional ``int32 [T]``; positions ≥ topk_length[t] are ignored (and not read).
        out, lse: optional preallocated outputs ``[T, h, 512]`` (q.dtype) and ``float32 [T, h]``.
        config: launch configuration; default from :func:`default_decode_config` (tuned entries win).

    Returns:
        ``(o [T, h, 512] q.dtype, lse [T, h] float32)``, lse in natural log; empty rows give o = 0, lse = +inf.

    Raises:
        ValueError: on shape/dtype mismatches (the message carries the offending values).
    """
    import torch

    if q.dim() != 3 or q.shape[-1] != D_QK:
        raise ValueError(f"q must be [T, h, 576], got {tuple(q.shape)}")
    t_rows, heads, _ = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    fp8 = kv.dtype == torch.uint8
    if fp8:
        kv2 = kv.reshape(-1, kv.shape[-1])
        if kv2.shape[-1] != 656 or kv2.stride(-1) != 1 or kv2.stride(0) != 656:
            raise ValueError(f"FP8 kv must be contiguous uint8 [slots, 656], got {tuple(kv.shape)}")
        kv_main = kv2.view(torch.float8_e4m3fn)
        kv_sc = kv2.view(torch.float32)
        kv_rope = kv2.view(torch.bfloat16)
        stride_kv, stride_kvs, stride_kvr, rope_off = 656, 164, 328, 264
    else:
        kv2 = kv.reshape(-1, kv.shape[-1])
        if kv2.shape[-1] != D_QK or kv2.stride(-1) != 1:
            raise ValueError(f"kv must be [slots, 576] (or uint8 [slots, 656]), got {kv.dtype} {tuple(kv.shape)}")
        if kv2.dtype != q.dtype:
            raise ValueError(f"kv dtype {kv2.dtype} must match q dtype {q.dtype}")
        if kv2.stride(0) % 16:
            raise ValueError(f"kv row stride must be a multiple of 16 elements (16-byte loads), got {kv2.stride(0)}")
        kv_main = kv_sc = kv_rope = kv2
        stride_kv = stride_kvs = stride_kvr = kv2.stride(0)
        rope_off = 512
    if indices.dim() != 2 or indices.shape[0] != t_rows:
        raise ValueError(f"indices must be [T={t_rows}, K], got {tuple(indices.shape)}")
    if indices.dtype != torch.int32:
        raise ValueError(f"indices must be int32, got {indices.dtype}")
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    k = indices.shape[1]
    if topk_length is not None and (topk_length.shape != (t_rows,) or topk_length.dtype != torch.int32):
        raise ValueError(f"topk_length must be int32 [{t_rows}], got {topk_length.dtype} {tuple(topk_length.shape)}")

    cfg = config or default_decode_config(heads, t_rows, "fp8" if fp8 else "bf16", _num_sms(q.device), k)
    check_decode_config(cfg, heads, t_rows, "fp8" if fp8 else "bf16", _num_sms(q.device))
    if cfg.gluon and q.dtype != torch.bfloat16:
        raise ValueError(f"the Gluon kernels need bf16 q, got {q.dtype} (config {cfg})")
    grid = (t_rows, -(-heads // cfg.block_h), cfg.splits)
    split_launch = _pdl_launch(q, cfg.pdl)
    merge_launch = _pdl_launch(q, min(cfg.pdl, 1))  # the merge is short: it triggers at its start
    if out is None:
        out = torch.empty(t_rows, heads, D_V, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(t_rows, heads, dtype=torch.float32, device=q.device)
    if t_rows == 0:
        return out, lse
    if cfg.splits > 1:
        mid_o = torch.empty(t_rows, heads, cfg.splits, D_V, dtype=torch.bfloat16 if cfg.bf16_partials else torch.float32,
                            device=q.device)
        mid_l = torch.empty(t_rows, heads, cfg.splits, dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_l = lse  # unused
    main_k, comb_k = _kernels()
    if cfg.gluon:
        if cfg.gluon in WS_HEAD_BLOCKS:  # (config checked above)
            kernel, launch = _gluon_ws_kernel(), _ws_launch(cfg.gluon, cfg.block_h, cfg.splits)
            if cfg.merge:  # (checked above: splits > 1, the grid fits one program per SM)
                s_p2, lanes = _next_pow2(cfg.splits), _next_pow2(-(-D_V // cfg.splits))
                launch.update(MERGE=True, MERGE_S_P2=s_p2, MERGE_DL=lanes, bar_ptr=_grid_barrier_counter(q),
                              launch_cooperative_grid=True)
        else:
            kernel, launch = _gluon_kernel(), {"STAGES": {1: 2, 2: 1, 3: 0}[cfg.gluon], "num_warps": 4}
        compiled = kernel[grid](
            q, q.stride(0), q.stride(1), kv_main, kv_sc, kv_rope, indices, indices.stride(0),
            topk_length if topk_length is not None else indices,
            out, out.stride(0), out.stride(1), lse, lse.stride(0), mid_o, mid_l,
            heads, k, float(sm_scale) * 1.4426950408889634, cfg.splits,
            HAS_LEN=topk_length is not None, SPLIT_OUT=cfg.splits > 1, BLOCK_H=cfg.block_h, **launch, **split_launch,
        )
    else:
        compiled = main_k[grid](
            q, q.stride(0), q.stride(1),
            kv_main, stride_kv, kv_sc, stride_kvs, kv_rope, stride_kvr,
            indices, indices.stride(0),
            topk_length if topk_length is not None else indices,
            out, out.stride(0), out.stride(1), lse, lse.stride(0),
            mid_o, mid_l,
            heads, k, float(sm_scale) * 1.4426950408889634, cfg.splits,
            ROPE_OFF=rope_off, FP8=fp8, HAS_LEN=topk_length is not None, SPLIT_OUT=cfg.splits > 1,
            PREFETCH=cfg.prefetch == 1, RELOAD=fp8 and cfg.prefetch == 2,
            FOLD=fp8 and bool(cfg.fold), MMA_F16=fp8 and bool(cfg.mma_f16), QK_CHAINS=bool(cfg.qk_chains),
            BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **split_launch,
        )
    LAST_LAUNCH.update(n_regs=getattr(compiled, "n_regs", None), n_spills=getattr(compiled, "n_spills", None))
    if cfg.splits > 1 and not cfg.merge:
        _launch_combine(comb_k, mid_o, mid_l, out, lse, t_rows, heads, cfg, None, merge_launch)
    return out, lse


def _launch_combine(comb_k, mid_o, mid_l, out, lse, t_rows: int, heads: int, cfg: DecodeConfig, sink, launch) -> None:
    """Merge ``cfg.splits`` partials into ``out`` / ``lse`` (``_combine_kernel``), scaling by the attention ``sink``
    (fp32 [≥ heads]) where given (V4)."""
    block_d = _combine_block_d(t_rows * heads, _num_sms(out.device))
    block_s = max(2, _next_pow2(cfg.splits))
    comb_k[(t_rows, heads, D_V // block_d)](
        mid_o, mid_l, out, out.stride(0), out.stride(1), lse, lse.stride(0), heads, cfg.splits,
        sink if sink is not None else mid_l,
        BLOCK_S=block_s, BLOCK_D=block_d, num_warps=_combine_warps(block_s, block_d, bool(cfg.bf16_partials)),
        HAS_SINK=sink is not None, **launch,
    )


def _v4_source(cache: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(e4m3 view, uint8 view, bf16 view, page_size, page stride in bytes) of a V4 cache view
    ``[pages, page_size, 1, 584]`` (``_reference.v4_cache_view``); refuses any other layout."""
    import torch

    if (cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != 584 or cache.element_size() != 1
            or cache.stride(3) != 1 or cache.stride(1) != 584):
        raise ValueError(f"{name} must be a V4 cache view [pages, page_size, 1, 584] of bytes with rows 584 B apart, "
                         f"got {cache.dtype} {tuple(cache.shape)} strides {cache.stride()}")
    stride = cache.stride(0)
    if stride % 64 or stride < cache.shape[1] * 584 or cache.data_ptr() % 16:
        raise ValueError(f"{name}: the page stride ({stride} B) must be a multiple of 64 B holding a whole page "
                         f"({cache.shape[1]} x 584 B; SGLang pads pages to 576 B) and the base 16-byte aligned")
    u8 = cache.view(torch.uint8)
    return u8.view(torch.float8_e4m3fn), u8, u8.view(torch.bfloat16), cache.shape[1], stride


def sparse_decode_v4(
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 sparse decode (FlashMLA ``flash_mla_with_kvcache`` on the 584-byte "V4"/MODEL1 cache, sgl-flash-mla
    1.0.0, as sglang 0.5.23's dsv4 backend calls it for decode): tensor-core split-K flash-decoding over two KV
    sources, the ``_sparse_mla_decode_kernel`` family's structure (grid (rows, head blocks, splits), online softmax in
    base 2 from a −1e30 sentinel, normalised partials merged by ``_combine_kernel``). Semantics: ``_reference``
    :func:`reference_sparse_decode_v4`.

    Args:
        q: ``[T, h, 512]`` (a strided view such as SGLang's ``q[:, 0, :h]`` is fine; unit stride on the last dim),
            bf16 on a GPU (fp16/fp32 too: the CPU interpreter tests use fp32). Any h ≥ 1 (8–128 deployed).
        cache: main KV source, a V4 cache view ``[pages, page_size, 1, 584]`` (SGLang: the SWA cache, 256-token
            pages); ``indices`` ``int32 [T, K1]`` its physical slots, −1 invalid; ``topk_length`` optional
            ``int32 [T]``: only the first topk_length[t] entries of row t count.
        sm_scale: softmax scale (V4: head_dim^-0.5 = 512^-0.5, sglang 0.5.23 ``DeepseekV4AttnBackend.softmax_scale``).
        attn_sink: optional fp32 ``[≥ h]``: o[t, h] ·= 1 / (1 + exp(sink[h] − lse[t, h])).
        extra_cache, extra_indices, extra_topk_length: optional second source, the same way (SGLang: the c4 cache
            with the indexer's top-512/1024, or the c128 cache with every compressed row).
        out, lse: optional outputs ``[T, h, 512]`` (q.dtype) and ``float32 [T, h]`` (strided views allowed).
        config: launch configuration (block_h, block_n, num_warps, num_stages, splits, pdl, bf16_partials); default
            :func:`default_decode_config` for ``"v4"``.

    Returns:
        ``(o [T, h, 512], lse [T, h] float32)``; rows with nothing to attend give o = 0, lse = +inf.

    Raises:
        ValueError: shapes, dtypes or layouts it does not take (the message names them).
    """
    import torch

    if q.dim() != 3 or q.shape[-1] != 512 or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, h, 512] with unit last stride, got {tuple(q.shape)} {q.stride()}")
    t_rows, heads, _ = q.shape
    c8, cu8, cbf, ps, pstride = _v4_source(cache, "cache")

    def index_rows(idx, length, what):
        if idx.dim() != 2 or idx.shape[0] != t_rows or idx.dtype != torch.int32 or idx.stride(-1) != 1:
            raise ValueError(f"{what} must be int32 [T={t_rows}, K] with unit last stride, got {idx.dtype} "
                             f"{tuple(idx.shape)}")
        if length is not None and (length.shape != (t_rows,) or length.dtype != torch.int32):
            raise ValueError(f"the lengths of {what} must be int32 [{t_rows}], got {length.dtype} {tuple(length.shape)}")

    index_rows(indices, topk_length, "indices")
    has_extra = extra_cache is not None
    if has_extra:
        if extra_indices is None:
            raise ValueError("extra_cache needs extra_indices")
        e8, eu8, ebf, eps, estride = _v4_source(extra_cache, "extra_cache")
        index_rows(extra_indices, extra_topk_length, "extra_indices")
        k2 = extra_indices.shape[1]
    else:
        e8, eu8, ebf, eps, estride, k2 = c8, cu8, cbf, ps, pstride, 0
        extra_indices = indices
    if attn_sink is not None and (attn_sink.dtype != torch.float32 or attn_sink.dim() != 1
                                  or attn_sink.shape[0] < heads or attn_sink.stride(0) != 1):
        raise ValueError(f"attn_sink must be contiguous float32 [>= {heads}], got {attn_sink.dtype} "
                         f"{tuple(attn_sink.shape)}")
    k1 = indices.shape[1]
    cfg = config or default_decode_config(heads, t_rows, "v4", _num_sms(q.device), k1 + k2)
    check_decode_config(cfg, heads, t_rows, "v4", _num_sms(q.device))
    if out is None:
        out = torch.empty(t_rows, heads, D_V, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(t_rows, heads, dtype=torch.float32, device=q.device)
    if out.shape != (t_rows, heads, D_V) or out.stride(-1) != 1 or lse.shape != (t_rows, heads):
        raise ValueError(f"out must be [{t_rows}, {heads}, 512] (unit last stride) and lse [{t_rows}, {heads}], got "
                         f"{tuple(out.shape)} and {tuple(lse.shape)}")
    if t_rows == 0:
        return out, lse
    if cfg.splits > 1:
        mid_o = torch.empty(t_rows, heads, cfg.splits, D_V,
                            dtype=torch.bfloat16 if cfg.bf16_partials else torch.float32, device=q.device)
        mid_l = torch.empty(t_rows, heads, cfg.splits, dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_l = lse  # unused
    grid = (t_rows, -(-heads // cfg.block_h), cfg.splits)
    compiled = _v4_kernel()[grid](
        q, q.stride(0), q.stride(1),
        c8, cu8, cbf, ps, pstride, indices, indices.stride(0), topk_length if topk_length is not None else indices, k1,
        e8, eu8, ebf, eps, estride, extra_indices, extra_indices.stride(0),
        extra_topk_length if extra_topk_length is not None else extra_indices, k2,
        attn_sink if attn_sink is not None else lse,
        out, out.stride(0), out.stride(1), lse, lse.stride(0), mid_o, mid_l,
        heads, float(sm_scale) * 1.4426950408889634, cfg.splits,
        HAS_LEN=topk_length is not None, HAS_EXTRA=has_extra, HAS_ELEN=has_extra and extra_topk_length is not None,
        HAS_SINK=attn_sink is not None and cfg.splits == 1, SPLIT_OUT=cfg.splits > 1,
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_pdl_launch(q, cfg.pdl),
    )
    LAST_LAUNCH.update(n_regs=getattr(compiled, "n_regs", None), n_spills=getattr(compiled, "n_spills", None))
    if cfg.splits > 1:
        _launch_combine(_kernels()[1], mid_o, mid_l, out, lse, t_rows, heads, cfg, attn_sink,
                        _pdl_launch(q, min(cfg.pdl, 1)))
    return out, lse
