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
   contiguous page; the 8 KB of keys as one bulk tensor copy on sm_90+ with ``chunk_pages`` 1,
   ``IndexerConfig.logits_tma``), ``tl.dot(k8, q8ᵀ)`` (fp8 wgmma on sm_90, fp32 accumulate) →
   ``[tokens, 64 heads]``, ReLU per head, ``· w[None, :]``, sum over heads (inside each warp: tokens are the
   MMA's rows), ``· k_scale``, and stores the logits at ``logits[b, pos]`` for pos < L_b only. Nothing is pre-filled.
2. Top-k, exact, over the L_b logits of each row, as a radix select on order-preserving int32 keys of the fp32
   logits (``_indexer_kernels``), in three launches:

   * ``_topk_hist_kernel``: a 256-bin histogram of the keys' top byte (or counted by the logits kernel as it
     writes the logits, with ``fuse_hist0``); it fixes d0, the top byte of the k-th largest key. Each block of keys
     is counted with a 32-bin histogram of the 16 top bytes below each sign's largest, or with 256 bins when a key
     falls outside those windows (exact either way);
   * ``_topk_partition_kernel``: keys whose top byte is above d0 go straight to the output; keys that share d0
     are candidates, their output values (slots) and keys appended to a per-row list while a 4096-bin histogram
     of their next 12 bits is counted (one global atomic per candidate);
   * ``_topk_refine_kernel``, on the same grid: with those 12 bits fixed, the candidates above them
     go to the output and the few that share them to a short list; the row's last program resolves the last
     12 bits over the short list in registers and writes the rest of the row.

   Exactly k entries come out, unsorted (SGLang's contract is unsorted). All three run on a ``(B, R)`` grid,
   R = max(1, topk_programs // B) programs splitting each row (so one long row still spreads over the GPU; a
   program whose share of a short row is empty exits at once). The workspace (histograms and counters) is
   zeroed by the logits kernel: a call is four launches. Rows with L_b ≤ k write ``[0 .. L_b−1, −1 …]``.
   Positions are mapped to physical slots ``block_table[b, pos // 64] · 64 + pos % 64`` as they are written
   (SGLang's ``fast_topk_transform_fused``), or left logical with ``physical=False``. Which of several keys tied
   at the k-th value are kept depends on scheduling (as in sgl-kernel's radix top-k).

DeepSeek-V4 (sglang 0.5.23 ``layers/attention/dsv4/indexer.py``, C4 indexer, FP8 keys on SM90): the same op over
compressed rows — ``index_k_cache`` is the c4 index-K pool (``[pages, 64·132]``: 64 compressed rows of 128 e4m3 keys,
then their 64 fp32 scales, ``fp8_paged_mqa_logits_torch``'s ``SCALE_OFFSET = 64·128``), ``block_table`` the
``indexer_metadata.page_table`` (one 64-row c4 page per 256-token page), ``seq_lens`` the ``compressed_seq_lens``
(seq_lens // 4) and ``topk`` the config's ``index_topk``, 512 (Flash) or 1024 (Pro); the physical slots go to
``core_metadata.c4_sparse_page_indices`` (``sglang_plugin``).

The logits workspace ``[B, width·64]`` fp32 and the candidate list ``[B, 2, width·64]`` int32 are allocated with
``torch.empty``: only the first L_b columns of row b are ever written or read, so the width costs address space,
not time (the tests check output and time are the same at widths for 32K and 160K max context). Layout and math: ``_reference.py``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["IndexerConfig", "lightning_indexer", "indexer_logits", "topk_over_logits"]

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
    topk_refine_cap: int = 2048
    """Most keys sharing the k-th key's top 20 bits that a row's refining program holds in registers; with more
    (heavily tied logits) it loops over the whole candidate list (a power of two ≥ 1024)."""
    refine_warps: int = 8
    """Warps of each refining program (``topk_programs // B`` programs per row, as the other top-k launches)."""
    refine_block: int = 1024
    """Candidates per step of a refining program (8 warps, 1024: the best all-round of the sweep in
    ``bench_kernels.py --sections isweep`` on the H200, 2026-11-30)."""
    logits_tma: int = 1
    """1: the logits kernel loads each page's keys with one bulk tensor copy (TMA) where it can (``chunk_pages`` 1
    on an NVIDIA sm_90+ GPU or Triton's interpreter, a non-empty cache on 16 bytes: ``_has_tma``), per-thread
    asynchronous copies elsewhere; 0: always per-thread copies. On the H200 (2026-11-30) TMA took the whole call
    from 462.5 to 425.0 µs at L = 128K, B = 64 and from 132.9 to 123.6 µs at L = 32K, B = 64, and was within 0.3 µs
    or faster at the seven other benchmark shapes (``kernels/RESULTS.md``): the copies no longer cost the programs'
    registers and issue slots."""
    fuse_hist0: int = 0
    """1: the logits kernel also counts the top-k's first (top-byte) histogram, saving a pass over the logits;
    0: a separate pass does (measured on the H200 at 2M keys: fused, the 256-bin ``tl.histogram`` made the
    logits kernel issue-bound, +60 µs, against ~10 µs for the separate pass)."""
    pdl: int = 2
    """Programmatic dependent launch of the four kernels (``pdctl.kernels._gdc``; sm_90+ and Triton 3.3+, plain
    launches elsewhere): 0 plain launches; 1 and 2: each kernel waits for the previous one before touching memory
    and lets the next launch at its start (1) or after its main loop (2). 2 by default: on the H200 it saved
    0.4–2.9 µs a call at 7 of the 9 benchmark shapes and cost 0.7 µs (L = 8K, B = 64) and 2.3 µs (0.5 %, ΣL = 8M)
    at the other two; the early trigger (1) cost up to 39 µs there, the next kernel's waiting programs sitting
    on the SMs during the logits pass (``kernels/RESULTS.md``)."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


_TUNED: dict[str, IndexerConfig] = {}

WS_STRIDE = 512 + 4096
"""int32 per row of the top-k workspace: the 256-bin first histogram (0–255); the partition's output and
candidate counters (256, 257); the refinement's arrival counter (258); the k-th key's top byte and the count still
needed at it (259, 260); the refinement's short-list length (261), output and short-list counters (262, 263);
the candidates' 4096-bin second histogram (512–4607) (``_indexer_kernels``)."""


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


def _has_tma(cache: torch.Tensor) -> bool:
    """Whether the logits kernel can load ``cache``'s keys by bulk tensor copies (TMA): an NVIDIA sm_90+ GPU or
    Triton's interpreter (CPU tensors), a cache of at least one page, and a base address on 16 bytes (the tensor
    map's requirement, CUDA driver API ``cuTensorMapEncodeTiled``)."""
    import torch

    if cache.shape[0] == 0 or cache.data_ptr() % 16:
        return False
    if cache.device.type != "cuda":
        return True
    return torch.version.hip is None and torch.cuda.get_device_capability(cache.device)[0] >= 9


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
    workspace: torch.Tensor | None = None,
    count_hist0: bool = False,
) -> torch.Tensor:
    """Indexer logits into ``logits [B, ≥ width·64] fp32``: row b is defined on columns [0, L_b) only (the rest
    is left untouched). Arguments as :func:`lightning_indexer`. ``workspace``: the top-k's ``int32 [B, WS_STRIDE]``
    workspace, which this launch zeroes; or, with ``count_hist0``, which the caller has zeroed and into which it
    counts the top-k's first radix histogram (row b at ``workspace[b, :256]``)."""
    import torch

    _check(q8, weights, index_k_cache, block_table, seq_lens)
    cfg = config or _TUNED.get("default") or IndexerConfig()
    b = q8.shape[0]
    width = block_table.shape[1] * 64
    if logits is None:
        logits = torch.empty(b, max(width, 1), dtype=torch.float32, device=q8.device)
    if b == 0:
        return logits
    from pdctl.kernels._sparse_mla import _pdl_launch

    programs = cfg.programs_per_sm * _num_sms(q8.device)
    kern = _kernels()
    kc = index_k_cache.view(torch.float8_e4m3fn)
    ks = index_k_cache.view(torch.float32)
    k_desc = None
    if cfg.logits_tma and cfg.chunk_pages == 1 and _has_tma(index_k_cache):
        from triton.tools.tensor_descriptor import TensorDescriptor

        # The cache as 128-byte e4m3 rows, 66 a page (64 key rows, then 2 rows holding the 64 fp32 scales).
        k_desc = TensorDescriptor.from_tensor(kc.view(-1, 128), block_shape=[64, 128])
    kern._indexer_logits_kernel[(programs,)](
        q8, weights, kc, ks, block_table, block_table.stride(0), seq_lens, logits, logits.stride(0),
        workspace if workspace is not None else seq_lens, WS_STRIDE,
        0 if workspace is None or count_hist0 else workspace.numel(),
        b, programs, k_desc, BLOCK_B=max(16, _next_pow2(b)), PAGES=cfg.chunk_pages,
        HIST=workspace is not None and count_hist0, TMA=k_desc is not None,
        num_warps=cfg.logits_warps,
        num_stages=cfg.logits_stages,
        **_pdl_launch(q8, cfg.pdl),
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
    out = _output(out, b, topk, q8.device)
    ws = (torch.zeros if cfg.fuse_hist0 else torch.empty)(b, WS_STRIDE, dtype=torch.int32, device=q8.device)
    logits = indexer_logits(q8, weights, index_k_cache, block_table, seq_lens, logits=logits, config=cfg,
                            workspace=ws, count_hist0=bool(cfg.fuse_hist0))
    _topk(logits, seq_lens, block_table, out, ws, topk, physical, cfg, hist0_done=bool(cfg.fuse_hist0))
    return out


def topk_over_logits(
    logits: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    topk: int = 2048,
    *,
    physical: bool = True,
    out: torch.Tensor | None = None,
    config: IndexerConfig | None = None,
) -> torch.Tensor:
    """The indexer's exact top-k on its own: ``logits`` fp32 ``[B, ≥ L_b]`` (row b read on [0, L_b) only),
    ``seq_lens`` int32 ``[B]``, ``block_table`` int32 ``[B, W]`` (read only with ``physical``). Returns int32
    ``[B, topk]`` as :func:`lightning_indexer` does; one extra launch zeroes the workspace that
    :func:`lightning_indexer` has the logits kernel zero. Raises ValueError on shape/dtype mismatches."""
    import torch

    cfg = config or _TUNED.get("default") or IndexerConfig()
    b = seq_lens.shape[0]
    if logits.dim() != 2 or logits.shape[0] != b or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be float32 [{b}, ≥ max L] (unit column stride), got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    if seq_lens.dtype != torch.int32 or block_table.dtype != torch.int32 or block_table.shape[0] != b:
        raise ValueError(f"seq_lens must be int32 [{b}] and block_table int32 [{b}, W], got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)} and {block_table.dtype} {tuple(block_table.shape)}")
    out = _output(out, b, topk, logits.device)
    ws = torch.zeros(b, WS_STRIDE, dtype=torch.int32, device=logits.device)
    _topk(logits, seq_lens, block_table, out, ws, topk, physical, cfg, hist0_done=False)
    return out


def _output(out, b: int, topk: int, device):  # noqa: ANN001, ANN202
    import torch

    if out is None:
        return torch.empty(b, topk, dtype=torch.int32, device=device)
    if out.shape != (b, topk) or out.dtype != torch.int32 or out.stride(1) != 1:
        raise ValueError(f"out must be int32 [{b}, {topk}], got {out.dtype} {tuple(out.shape)}")
    return out


def candidate_buffer(b: int, cw: int, cfg: IndexerConfig, device) -> torch.Tensor:
    """The top-k's per-row candidate lists, ``int32 [B, 2·cw + 2·cap]``: output values (physical slots, or positions
    with ``physical=False``) and keys of the keys sharing the k-th key's top byte (cw = the logits row length,
    each), then the refinement's short list (values and keys, ``cfg.topk_refine_cap`` each)."""
    import torch

    return torch.empty(b, 2 * cw + 2 * cfg.topk_refine_cap, dtype=torch.int32, device=device)


def _topk(logits, seq_lens, block_table, out, ws, topk: int, physical: bool, cfg: IndexerConfig, hist0_done: bool):
    # The three top-k launches (first histogram unless already counted, then partition and refinement) on a zeroed
    # workspace ``ws`` int32 [B, WS_STRIDE] (or one holding the first histogram, with hist0_done).
    b = seq_lens.shape[0]
    if b == 0:
        return
    kern = _kernels()
    cw = max(logits.shape[1], 1)
    cand = candidate_buffer(b, cw, cfg, logits.device)
    block = cfg.topk_block
    segs = max(1, cfg.topk_programs // b)
    from pdctl.kernels._sparse_mla import _pdl_launch

    gdc = _pdl_launch(logits, cfg.pdl)
    if not hist0_done:
        kern._topk_hist_kernel[(b, segs)](
            logits, logits.stride(0), seq_lens, ws, WS_STRIDE, TOPK=topk, BLOCK=block, num_warps=cfg.topk_warps,
            num_stages=cfg.topk_stages, **gdc,
        )
    kern._topk_partition_kernel[(b, segs)](
        logits, logits.stride(0), seq_lens, ws, WS_STRIDE, cand, cand.stride(0), cw, block_table, block_table.stride(0),
        out, out.stride(0), TOPK=topk, BLOCK=block, PHYSICAL=physical, num_warps=cfg.topk_warps,
        num_stages=cfg.topk_stages, **gdc,
    )
    kern._topk_refine_kernel[(b, segs)](
        seq_lens, ws, WS_STRIDE, cand, cand.stride(0), cw, out, out.stride(0),
        TOPK=topk, BLOCK=cfg.refine_block, CAP=cfg.topk_refine_cap, num_warps=cfg.refine_warps,
        **gdc,
    )
