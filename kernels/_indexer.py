"""Lightning indexer (DeepSeek-V3.2 DSA) for decode in Triton: O(Σ L_b) logits plus an exact top-k over L_b.

Every launch has a grid fixed by the host's SM count and the batch size — never by the block table's
width or the max context (the failure mode of the spec §4.2: SGLang's contract hands a replacement a
full-width block table and ``max_seq_len = width · 64``; vLLM PR #40991 lost 2x tok/s by sizing a grid by it):

1. ``_indexer_logits_kernel``: a persistent grid of P programs (P = programs_per_sm x SMs). Each program derives
   the work list from ``seq_lens`` on the device — pages ``p_b = ceil(L_b / 64)``, a run length
   ``seg = ceil(Σ p_b / (P − B))`` pages (so that the Σ n_b ≤ P runs fit one wave), ``n_b = ceil(p_b / seg)``
   runs per request and their prefix sum — so it needs
   no host sync and no extra launch (CUDA-graph safe), and is balanced whatever the mix of lengths; program p
   walks runs p, p+P, … Run (b, i) loads q8[b] ``[64, 128]`` e4m3 and w[b] once, then for each ``chunk_pages``
   64-token pages of its run: the keys ``[64, 128]`` e4m3 and 64 fp32 scales of each page (8448 B, one
   contiguous page), ``tl.dot(k8, q8ᵀ)`` (fp8 wgmma on sm_90, fp32 accumulate) → ``[tokens, 64 heads]``, ReLU
   per head, ``· w[None, :]``, sum over heads (inside each warp: tokens are the MMA's rows), ``· k_scale``, and
   stores the logits at ``logits[b, pos]`` for pos < L_b only. Nothing is pre-filled.
2. Top-k, exact, over the L_b logits of each row, as a radix select on order-preserving int32 keys of the fp32
   logits, high bits first: a 256-bin histogram of the top byte (``_topk_hist_kernel`` pass 0, or counted by the
   logits kernel as it writes the logits with ``fuse_hist0``), then four 6-bit digits (passes 1–4, 64-bin
   histograms of the keys that match
   the digits picked so far), then ``_topk_select_kernel`` writes every key above the k-th largest plus enough
   keys equal to it — exactly k entries, unsorted (SGLang's contract is unsorted). Each pass runs on a
   ``(B, R)`` grid, R = max(1, topk_programs // B) programs splitting each row (so one long row still spreads
   over the GPU; a program whose share of a short row is empty exits at once), accumulating with global
   atomics. Rows with L_b ≤ k write ``[0 .. L_b−1, −1 …]``. Positions
   are mapped to physical slots ``block_table[b, pos // 64] · 64 + pos % 64`` in the select pass (SGLang's
   ``fast_topk_transform_fused``), or left logical with ``physical=False``. Which of several keys tied at the
   k-th value are kept depends on scheduling (as in sgl-kernel's radix top-k).

The logits workspace is ``[B, width·64]`` fp32 allocated with ``torch.empty``: only its first L_b columns of row b
are ever written or read, so the width costs address space, not time (the tests check output and time are
the same at widths for 32K and 160K max context). Layout and math: ``_reference.py``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["IndexerConfig", "lightning_indexer", "indexer_logits"]

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class IndexerConfig:
    """``chunk_pages``: 64-token pages per step of the logits loop (the MMA's M = 64·chunk_pages);
    ``programs_per_sm``: persistent logits programs per SM; ``logits_stages``: software-pipelining depth of the
    page loop; ``topk_programs``: target programs per top-k pass (split over the rows: R = max(1,
    topk_programs // B); programs whose share of a short row is empty exit at once)."""

    chunk_pages: int = 1
    programs_per_sm: int = 4
    logits_warps: int = 4
    logits_stages: int = 5
    topk_block: int = 1024
    topk_warps: int = 4
    topk_programs: int = 528
    topk_stages: int = 3
    fuse_hist0: int = 0
    """1: the logits kernel also counts the top-k's first (top-byte) histogram, saving a pass over the logits;
    0: a separate pass does (measured on the H200 at 2M keys: fused, the 256-bin ``tl.histogram`` made the
    logits kernel issue-bound, +60 µs, against ~10 µs for the separate pass)."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


_TUNED: dict[str, IndexerConfig] = {}


def set_indexer_config(cfg: IndexerConfig) -> None:
    """Install the tuned config (used by ``load_manifest`` / ``build_and_verify``)."""
    _TUNED["default"] = cfg


@functools.cache
def _kernels() -> Any:
    from pdctl.kernels import _indexer_kernels

    return _indexer_kernels


def _num_sms(device: torch.device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _check(q8: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, bt: torch.Tensor, sl: torch.Tensor) -> None:
    import torch

    b = q8.shape[0]
    if q8.shape != (b, 64, 128) or q8.dtype != torch.float8_e4m3fn or not q8.is_contiguous():
        raise ValueError(f"q8 must be contiguous float8_e4m3fn [B, 64, 128], got {q8.dtype} {tuple(q8.shape)}")
    if weights.shape != (b, 64) or weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError(f"weights must be contiguous float32 [{b}, 64], got {weights.dtype} {tuple(weights.shape)}")
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != 8448 or not cache.is_contiguous():
        raise ValueError(f"index_k_cache must be contiguous uint8 [pages, 8448], got {cache.dtype} {tuple(cache.shape)}")
    if bt.dim() != 2 or bt.shape[0] != b or bt.dtype != torch.int32 or bt.stride(1) != 1:
        raise ValueError(f"block_table must be int32 [{b}, W] (unit column stride), got {bt.dtype} {tuple(bt.shape)}")
    if sl.shape != (b,) or sl.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [{b}], got {sl.dtype} {tuple(sl.shape)}")


def indexer_logits(
    q8: torch.Tensor,
    weights: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    logits: torch.Tensor | None = None,
    config: IndexerConfig | None = None,
    hist: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexer logits into ``logits [B, ≥ width·64] fp32``: row b is defined on columns [0, L_b) only (the rest
    is left untouched). Arguments as :func:`lightning_indexer`; ``hist`` (int32, ≥ 256·B, zeroed by the caller)
    receives the top-k's first radix histogram (row b at ``hist[256·b:]``)."""
    import torch

    _check(q8, weights, index_k_cache, block_table, seq_lens)
    cfg = config or _TUNED.get("default") or IndexerConfig()
    b = q8.shape[0]
    width = block_table.shape[1] * 64
    if logits is None:
        logits = torch.empty(b, max(width, 1), dtype=torch.float32, device=q8.device)
    if b == 0:
        return logits
    programs = cfg.programs_per_sm * _num_sms(q8.device)
    kern = _kernels()
    kc = index_k_cache.view(torch.float8_e4m3fn)
    ks = index_k_cache.view(torch.float32)
    kern._indexer_logits_kernel[(programs,)](
        q8, weights, kc, ks, block_table, block_table.stride(0), seq_lens, logits, logits.stride(0),
        hist if hist is not None else seq_lens,
        b, programs, BLOCK_B=max(16, _next_pow2(b)), PAGES=cfg.chunk_pages, HIST=hist is not None,
        num_warps=cfg.logits_warps,
        num_stages=cfg.logits_stages,
    )
    return logits


def lightning_indexer(
    q8: torch.Tensor,
    weights: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int = 2048,
    *,
    physical: bool = True,
    out: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    config: IndexerConfig | None = None,
) -> torch.Tensor:
    """Decode-time lightning indexer: top-k token slots per request over exactly its L_b tokens.

    Args:
        q8: ``float8_e4m3fn [B, 64, 128]`` index queries, one row per request (decode, next_n = 1).
        weights: ``float32 [B, 64]`` head weights with the q scales and 64^-0.5·128^-0.5 folded in (as SGLang's
            ``weights`` passed to DeepGEMM ``fp8_paged_mqa_logits``).
        index_k_cache: ``uint8 [pages, 8448]`` paged FP8 index-K cache (132 B per token, see ``_reference``).
        block_table: ``int32 [B, W]`` 64-token page ids; only the first ceil(L_b/64) entries of row b are read, so
            W may be the full max-context width SGLang hands over under CUDA graphs.
        seq_lens: ``int32 [B]`` on the device, L_b including the new token; must satisfy L_b ≤ 64·W.
        topk: entries per output row (2048 for DeepSeek-V3.2).
        physical: emit physical slots (default) or logical positions.
        out: optional ``int32 [B, topk]`` output; logits: optional fp32 workspace ``[B, ≥ 64·W]``.

    Returns:
        ``int32 [B, topk]``: rows with L_b ≤ topk are ``[0..L_b−1, −1…]`` (mapped); others hold exactly topk
        distinct entries, unsorted; which of several keys tied at the k-th value are kept is unspecified.

    Raises:
        ValueError: on shape/dtype mismatches.
    """
    import torch

    cfg = config or _TUNED.get("default") or IndexerConfig()
    b = q8.shape[0]
    if out is None:
        out = torch.empty(b, topk, dtype=torch.int32, device=q8.device)
    if out.shape != (b, topk) or out.dtype != torch.int32 or out.stride(1) != 1:
        raise ValueError(f"out must be int32 [{b}, {topk}], got {out.dtype} {tuple(out.shape)}")
    hb = b * 256  # elements between one pass's histograms and the next
    ws = torch.zeros(5 * hb + 2 * b, dtype=torch.int32, device=q8.device)  # 5 histograms + 2 counters per row
    hist, cnt = ws[: 5 * hb], ws[5 * hb:]
    logits = indexer_logits(q8, weights, index_k_cache, block_table, seq_lens, logits=logits, config=cfg,
                            hist=hist if cfg.fuse_hist0 else None)
    if b == 0:
        return out
    kern = _kernels()
    block = cfg.topk_block
    segs = max(1, cfg.topk_programs // b)
    for p in range(1 if cfg.fuse_hist0 else 0, 5):
        kern._topk_hist_kernel[(b, segs)](
            logits, logits.stride(0), seq_lens, hist, hb, PASS=p, TOPK=topk, BLOCK=block, num_warps=cfg.topk_warps,
            num_stages=cfg.topk_stages,
        )
    kern._topk_select_kernel[(b, segs)](
        logits, logits.stride(0), seq_lens, hist, hb, cnt, block_table, block_table.stride(0), out, out.stride(0),
        TOPK=topk, BLOCK=block, PHYSICAL=physical, num_warps=cfg.topk_warps,
        num_stages=cfg.topk_stages,
    )
    return out
