"""PyTorch references and cache-layout helpers for the DSA kernels (sparse-MLA decode, lightning indexer).

These run at build time on the target host (``build_and_verify`` compares the Triton kernels against them at
the deployment's shapes) and in the tests, so they live inside the package. They favour clarity over speed:
gathers, einsums and a Python loop over requests. Every function takes and returns plain tensors.

Conventions (spec: ``shared/reference/kernels.md`` §1; sources cited there):

* Sparse-MLA decode [FlashMLA @9241ae3 ``tests/ref.py``, ``tests/quant.py``]: a latent KV row is
  ``[c_kv 512 | k_pe 64]`` = 576; K is the whole row, V its first 512 lanes. ``s = q·Kᵀ · sm_scale`` over the
  selected rows; an index of −1, or a position at/after ``topk_length[t]``, is masked to −inf.
  ``lse = logsumexp(s)`` in natural log. A row with no valid index gives ``o = 0`` and ``lse = +inf``.
  The softmax scale is always explicit (DeepSeek-V3.2 uses 192^-0.5 · mscale² ≈ 0.135234, *not* 576^-0.5).
* FP8 KV "656-byte" layout [FlashMLA ``tests/quant.py``, V3.2 ``kv_format="V32"``]: per token
  512 B e4m3 (c_kv) | 16 B = 4 fp32 scales, one per 128 lanes | 128 B = 64 bf16 (k_pe, unquantized).
* Lightning indexer [DeepSeek-V3.2-Exp @3b99a53 ``inference/model.py`` ``Indexer``; DeepGEMM @54e2261
  ``tests/test_attention.py``]: ``logit[t,s] = k_scale[s] · Σ_j w[t,j] · ReLU(q8[t,j] · k8[s])``; the ReLU is
  per head *before* the weighted head sum (no folding the heads into one GEMV). Decode row ``b`` scores
  exactly its ``L_b = seq_lens[b]`` tokens (new token included). Top-k (k = 2048) over those L_b logits; a row
  with ``L_b ≤ k`` answers ``[0, 1, …, L_b−1, −1, …]``; indices are mapped to physical slots
  ``block_table[b, pos // 64] · 64 + pos % 64`` (−1 stays −1).
* Paged FP8 index-K cache [DeepGEMM ``kv_cache_cast_to_fp8``; vLLM ``mqa_logits_triton.py``]: 64-token pages of
  ``64·128 B e4m3 keys | 64 · fp32 scales`` = 8448 B per page = 132 B per token (SoA inside the page).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only; torch is imported lazily at call time
    import torch

__all__ = [
    "V4_BYTES_PER_TOKEN",
    "dequantize_kv584",
    "gather_kv584_rows",
    "quantize_kv584",
    "reference_sparse_decode_v4",
    "v4_cache_view",
    "v4_page_bytes",
    "INDEX_PAGE_BYTES",
    "INDEX_PAGE_TOKENS",
    "KV656_BYTES",
    "dequantize_kv656",
    "logical_to_physical",
    "pack_index_k_cache",
    "quantize_kv656",
    "reference_indexer_logits",
    "reference_lightning_indexer",
    "reference_sparse_mla_decode",
    "unpack_index_k_cache",
]

KV656_BYTES = 656
"""Bytes per token of the FP8 latent cache: 512 e4m3 + 4·4 scale bytes + 64·2 rope bytes."""
INDEX_PAGE_TOKENS = 64
"""Tokens per page of the indexer K cache (SGLang DSA asserts page_size == 64)."""
INDEX_PAGE_BYTES = INDEX_PAGE_TOKENS * 132
"""Bytes per index-K page: 64·128 e4m3 keys followed by 64 fp32 scales (8448)."""


def _ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    import torch

    # Power-of-two scale rounded up (DeepSeek ``act_quant`` with scale_fmt="ue8m0"): s = 2^ceil(log2(amax/448)).
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-4) / 448.0)))


def quantize_kv656(kv: torch.Tensor) -> torch.Tensor:
    """Quantize latent rows ``kv [N, 576]`` (any float dtype) into the 656-byte FP8 layout, ``uint8 [N, 656]``.

    Scales are ue8m0 (powers of two) per 128 lanes of the first 512, as FlashMLA's tests do; the 64 rope lanes
    are stored as bf16.
    """
    import torch

    if kv.dim() != 2 or kv.shape[1] != 576:
        raise ValueError(f"kv must be [N, 576], got {tuple(kv.shape)}")
    n = kv.shape[0]
    nope = kv[:, :512].float().view(n, 4, 128)
    scale = _ue8m0_scale(nope.abs().amax(-1))  # [N, 4]
    q = (nope / scale[:, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(n, 512)
    out = torch.empty(n, KV656_BYTES, dtype=torch.uint8, device=kv.device)
    out[:, :512] = q.view(torch.uint8)
    out[:, 512:528] = scale.contiguous().view(torch.uint8).view(n, 16)
    out[:, 528:] = kv[:, 512:].to(torch.bfloat16).contiguous().view(torch.uint8).view(n, 128)
    return out


def dequantize_kv656(buf: torch.Tensor) -> torch.Tensor:
    """Dequantize ``uint8 [N, 656]`` into ``float32 [N, 576]`` (FlashMLA ``tests/quant.py`` semantics)."""
    import torch

    if buf.dim() != 2 or buf.shape[1] != KV656_BYTES or buf.dtype != torch.uint8:
        raise ValueError(f"expected uint8 [N, 656], got {buf.dtype} {tuple(buf.shape)}")
    n = buf.shape[0]
    nope = buf[:, :512].contiguous().view(torch.float8_e4m3fn).float().view(n, 4, 128)
    sc = buf[:, 512:528].contiguous().view(torch.float32)  # [N, 4]
    rope = buf[:, 528:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(nope * sc[:, :, None]).view(n, 512), rope], -1)


def reference_sparse_mla_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    d_v: int = 512,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse-MLA decode in high precision.

    Args:
        q: absorbed queries ``[T, h, 576]``.
        kv: latent cache, either float ``[slots, 576]`` or the FP8 layout ``uint8 [slots, 656]`` (dequantized
            here first, so the reference sees exactly the values the kernel sees).
        indices: physical slots ``int32 [T, K]``; −1 marks an invalid entry.
        sm_scale: softmax scale applied to q·k (natural-log domain).
        topk_length: optional ``int32 [T]``; entries at positions ≥ topk_length[t] are ignored.
        d_v: value width (first ``d_v`` lanes of each row).
        compute_dtype: float64 by default (float32 is enough on a GPU for the tolerances used).

    Returns:
        ``o [T, h, d_v]`` in ``compute_dtype`` and ``lse [T, h]`` (natural log) in ``compute_dtype``; rows with no
        valid index give o = 0 and lse = +inf.
    """
    import torch

    cdt = compute_dtype or torch.float64
    t, k = indices.shape
    valid = indices >= 0
    if topk_length is not None:
        valid &= torch.arange(k, device=indices.device)[None, :] < topk_length.to(indices.device)[:, None]
    rows = kv.reshape(-1, kv.shape[-1])[indices.clamp_min(0).long().view(-1)]  # gather first, then dequantize
    if kv.dtype == torch.uint8:
        rows = dequantize_kv656(rows)
    g = rows.view(t, k, 576).to(cdt)  # [T, K, 576]
    s = torch.einsum("thd,tkd->thk", q.to(cdt), g) * sm_scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)  # [T, h]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("thk,tkd->thd", p, g[..., :d_v])
    dead = torch.isneginf(lse)  # no valid index: FlashMLA's o = 0, lse = +inf (where(), so CUDA graphs can capture it)
    o = torch.where(dead[..., None], torch.zeros_like(o), o)
    lse = lse.masked_fill(dead, float("inf"))
    return o, lse


def pack_index_k_cache(k8: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """Pack per-token FP8 keys ``k8 [pages·64, 128] e4m3`` and ``k_scale [pages·64] fp32`` into the paged
    index-K layout ``uint8 [pages, 8448]`` (per page: 64·128 key bytes, then 64 fp32 scales)."""
    import torch

    n = k8.shape[0]
    if n % INDEX_PAGE_TOKENS or k8.shape[1:] != (128,) or k_scale.shape != (n,):
        raise ValueError(f"need k8 [pages*64, 128] and k_scale [pages*64]; got {tuple(k8.shape)}, {tuple(k_scale.shape)}")
    pages = n // INDEX_PAGE_TOKENS
    out = torch.empty(pages, INDEX_PAGE_BYTES, dtype=torch.uint8, device=k8.device)
    out[:, :8192] = k8.contiguous().view(torch.uint8).view(pages, 8192)
    out[:, 8192:] = k_scale.float().contiguous().view(torch.uint8).view(pages, 256)
    return out


def unpack_index_k_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_index_k_cache`: ``(k8 [pages·64, 128] e4m3, k_scale [pages·64] fp32)``."""
    import torch

    if cache.dim() != 2 or cache.shape[1] != INDEX_PAGE_BYTES or cache.dtype != torch.uint8:
        raise ValueError(f"expected uint8 [pages, 8448], got {cache.dtype} {tuple(cache.shape)}")
    pages = cache.shape[0]
    k8 = cache[:, :8192].contiguous().view(torch.float8_e4m3fn).view(pages * 64, 128)
    ks = cache[:, 8192:].contiguous().view(torch.float32).view(pages * 64)
    return k8, ks


def logical_to_physical(pos: torch.Tensor, block_table_row: torch.Tensor) -> torch.Tensor:
    """Map logical positions (−1 allowed) of one request to physical slots through its 64-token block table."""
    import torch

    p = pos.long().clamp_min(0)
    phys = block_table_row.long()[p // INDEX_PAGE_TOKENS] * INDEX_PAGE_TOKENS + p % INDEX_PAGE_TOKENS
    return torch.where(pos >= 0, phys, torch.full_like(phys, -1)).to(torch.int32)


def reference_indexer_logits(
    q8: torch.Tensor,
    weights: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    compute_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Indexer logits per decode row: a list of ``B`` tensors, row b of length ``L_b = seq_lens[b]``.

    Args:
        q8: ``float8_e4m3fn [B, 64, 128]`` index queries (q scale already folded into ``weights``).
        weights: ``float32 [B, 64]`` head weights.
        index_k_cache: ``uint8 [pages, 8448]`` paged index-K cache.
        block_table: ``int32 [B, W]`` page ids (only the first ceil(L_b/64) entries of row b are read).
        seq_lens: ``int32 [B]``.
    """
    import torch

    cdt = compute_dtype or torch.float64
    k8, ks = unpack_index_k_cache(index_k_cache)
    out = []
    for b in range(q8.shape[0]):
        n = int(seq_lens[b])
        pos = torch.arange(n, device=q8.device)
        slot = logical_to_physical(pos, block_table[b]).long()
        s = torch.relu(q8[b].to(cdt) @ k8[slot].to(cdt).T)  # [64, L] — ReLU per head
        out.append((weights[b].to(cdt)[:, None] * s).sum(0) * ks[slot].to(cdt))
    return out


def reference_lightning_indexer(
    q8: torch.Tensor,
    weights: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int = 2048,
) -> torch.Tensor:
    """Top-k physical slots ``int32 [B, topk]`` over exactly each row's L_b logits (−1 padded; order unspecified;
    ties broken arbitrarily, as in SGLang's radix top-k)."""
    import torch

    logits = reference_indexer_logits(q8, weights, index_k_cache, block_table, seq_lens)
    out = torch.full((q8.shape[0], topk), -1, dtype=torch.int32, device=q8.device)
    for b, lg in enumerate(logits):
        n = min(topk, lg.numel())
        pos = torch.arange(n, device=q8.device) if lg.numel() <= topk else lg.topk(n, sorted=False).indices
        out[b, :n] = logical_to_physical(pos, block_table[b])
    return out


# --- DeepSeek-V4 ------------------------------------------------------------------------------------------------
#
# The V4 latent cache ("MODEL1" in FlashMLA, ``KVLayout.V4`` in SGLang) [FlashMLA @9241ae3 ``tests/quant.py``
# ``FP8KVCacheLayout.MODEL1_FP8Sparse``, whose layout sglang 0.5.23 ``kernels/ops/attention/dsv4/kv_layout.py``
# mirrors: ``data_bytes`` 576, ``scale_bytes`` 8, ``page_align`` 576, ``row_addressing``]. A token's latent row is
# 512 values: 448 "nope" lanes quantised to e4m3 in 7 tiles of 64, each tile with one ue8m0 (power-of-two, stored as
# float8_e8m0fnu) scale, then 64 RoPE lanes kept in bf16. A page of ``page_size`` tokens is stored block-split:
# ``page_size`` data rows of 576 B (448 e4m3 | 128 B bf16 rope), then ``page_size`` scale rows of 8 B (7 scales +
# 1 pad byte), the page padded to a multiple of 576 B. Slot s lives in page s // page_size, row s % page_size.
# Kernels see the cache as the view ``[pages, page_size, 1, 584]`` whose page stride is the padded page size
# (sglang 0.5.23 ``layers/attention/deepseek_v4_backend.py`` ``_forward_attention``; FlashMLA reads the format
# from the last dimension, 584). SGLang's V4 pools use pages of 256 tokens for the SWA cache and 256 / ratio
# compressed rows for the c4 (64) and c128 (2) caches (``mem_cache/deepseek_v4_memory_pool.py``).

V4_BYTES_PER_TOKEN = 584
"""448 e4m3 + 64 bf16 rope (128 B) + 7 ue8m0 scales + 1 pad byte."""
_V4_DATA = 576
_V4_SCALES = 8


def v4_page_bytes(page_size: int) -> int:
    """Bytes of one V4 page: ``page_size · 584`` rounded up to a multiple of 576 (sglang 0.5.23
    ``KVLayout.page_bytes``; FlashMLA ``tests/quant.py`` ``size_per_block_padded``)."""
    return -(-page_size * V4_BYTES_PER_TOKEN // 576) * 576


def v4_cache_view(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """The ``[pages, page_size, 1, 584]`` uint8 view of a V4 cache buffer ``uint8 [pages, v4_page_bytes(page_size)]``
    that FlashMLA and ``sparse_decode_v4`` take (what sglang 0.5.23 passes: ``buf[:, :page_size*584].view(...)``)."""
    if buf.dim() != 2 or buf.shape[1] < page_size * V4_BYTES_PER_TOKEN:
        raise ValueError(f"expected a V4 cache [pages, >= {page_size * V4_BYTES_PER_TOKEN}], got {tuple(buf.shape)}")
    return buf[:, : page_size * V4_BYTES_PER_TOKEN].view(buf.shape[0], page_size, 1, V4_BYTES_PER_TOKEN)


def _e8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    import torch

    # FlashMLA tests/quant.py ``_cast_scale_inv_to_ue8m0``: 2^ceil(log2(max(amax / 448, 1e-4))).
    return torch.pow(2, torch.clamp_min(amax / 448.0, 1e-4).log2().ceil())


def quantize_kv584(kv: torch.Tensor, page_size: int) -> torch.Tensor:
    """Quantise latent rows ``kv [pages·page_size, 512]`` (or ``[pages, page_size, 512]``) into V4 pages,
    ``uint8 [pages, v4_page_bytes(page_size)]`` (pad bytes zero). Written from FlashMLA @9241ae3
    ``tests/quant.py`` ``quantize_k_cache`` (``MODEL1_FP8Sparse``): per 64-lane tile of the 448 nope lanes the
    scale is ``2^ceil(log2(max(amax/448, 1e-4)))``, stored as float8_e8m0fnu, and the lanes ``(x / scale)`` cast to
    e4m3; the 64 rope lanes are stored as bf16."""
    import torch

    if kv.shape[-1] != 512:
        raise ValueError(f"kv must have 512 lanes, got {tuple(kv.shape)}")
    rows = kv.reshape(-1, 512)
    if rows.shape[0] % page_size:
        raise ValueError(f"{rows.shape[0]} rows are not whole pages of {page_size}")
    pages = rows.shape[0] // page_size
    x = rows.float().view(pages, page_size, 512)
    nope = x[..., :448].reshape(pages, page_size, 7, 64)
    scale = _e8m0_scale(nope.abs().amax(-1))  # [pages, ps, 7]
    q8 = (nope / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).reshape(pages, page_size, 448)
    out = torch.zeros(pages, v4_page_bytes(page_size), dtype=torch.uint8, device=kv.device)
    data = out[:, : page_size * _V4_DATA].view(pages, page_size, _V4_DATA)
    data[..., :448] = q8
    data[..., 448:] = rows.view(pages, page_size, 512)[..., 448:].to(torch.bfloat16).contiguous().view(torch.uint8)
    sc = out[:, page_size * _V4_DATA: page_size * V4_BYTES_PER_TOKEN].view(pages, page_size, _V4_SCALES)
    sc[..., :7] = scale.to(torch.float8_e8m0fnu).view(torch.uint8)
    return out


def _v4_geometry(cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(flat uint8 storage from the view's first byte, page_size, page stride in bytes) of a
    ``[pages, page_size, 1, 584]`` view (or a 2-D ``[pages, page_bytes]`` buffer is refused: pass the view)."""
    import torch

    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != V4_BYTES_PER_TOKEN or cache.element_size() != 1:
        raise ValueError(f"a V4 cache must be a [pages, page_size, 1, 584] byte view, got {cache.dtype} "
                         f"{tuple(cache.shape)}")
    if cache.stride(3) != 1 or cache.stride(1) != V4_BYTES_PER_TOKEN:
        raise ValueError(f"a V4 cache view must have rows 584 B apart, got strides {cache.stride()}")
    pages, ps = cache.shape[0], cache.shape[1]
    stride = cache.stride(0)
    if stride < ps * V4_BYTES_PER_TOKEN:
        raise ValueError(f"page stride {stride} is smaller than a page ({ps} x 584)")
    flat = torch.as_strided(cache.view(torch.uint8), ((pages - 1) * stride + ps * V4_BYTES_PER_TOKEN,), (1,))
    return flat, ps, stride


def gather_kv584_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The 584 bytes of each slot (``int [N]``, all ≥ 0) of a V4 cache view, as ``uint8 [N, 584]`` laid out as one
    token: 576 data bytes, then its 8 scale bytes."""
    import torch

    flat, ps, stride = _v4_geometry(cache)
    s = slots.long()
    page, row = s // ps, s % ps
    data = page * stride + row * _V4_DATA
    sc = page * stride + ps * _V4_DATA + row * _V4_SCALES
    lanes = torch.arange(_V4_DATA, device=s.device)
    lanes_s = torch.arange(_V4_SCALES, device=s.device)
    return torch.cat([flat[data[:, None] + lanes], flat[sc[:, None] + lanes_s]], -1)


def dequantize_kv584(rows: torch.Tensor) -> torch.Tensor:
    """``uint8 [N, 584]`` token rows (:func:`gather_kv584_rows`) → ``float32 [N, 512]``: e4m3 · ue8m0 scale per 64
    lanes for the 448 nope lanes, the bf16 rope lanes as they are (FlashMLA ``tests/quant.py`` ``dequantize_k_cache``;
    with power-of-two scales its bf16 product is exact, so float32 gives the same values)."""
    import torch

    if rows.dim() != 2 or rows.shape[1] != V4_BYTES_PER_TOKEN or rows.dtype != torch.uint8:
        raise ValueError(f"expected uint8 [N, 584], got {rows.dtype} {tuple(rows.shape)}")
    n = rows.shape[0]
    nope = rows[:, :448].contiguous().view(torch.float8_e4m3fn).float().view(n, 7, 64)
    scale = rows[:, _V4_DATA: _V4_DATA + 7].contiguous().view(torch.float8_e8m0fnu).float()  # [N, 7]
    rope = rows[:, 448:_V4_DATA].contiguous().view(torch.bfloat16).float()
    return torch.cat([(nope * scale[:, :, None]).view(n, 448), rope], -1)


def reference_sparse_decode_v4(
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 sparse decode in high precision (float64 by default), FlashMLA's semantics
    [FlashMLA @9241ae3 ``tests/ref.py`` ``ref_sparse_attn_decode``; sgl-flash-mla 1.0.0
    ``flash_mla/flash_mla_interface.py`` ``flash_mla_with_kvcache`` docstring].

    Each query row attends to the union of two KV sources: the main cache (SGLang: the sliding window) at
    ``indices [T, K1]`` and, when given, the extra cache (the compressed rows the indexer selected, or all c128
    rows) at ``extra_indices [T, K2]``. Entries equal to −1, or at positions ≥ ``topk_length[t]`` /
    ``extra_topk_length[t]`` of their own list, are ignored. K = V = the whole 512-lane dequantised row.
    ``s = q·Kᵀ·sm_scale``; ``lse = logsumexp(s)`` (natural log) over both sources; ``o = softmax(s)·V``. With
    ``attn_sink [h]`` (fp32) the output is scaled by ``1 / (1 + exp(sink[h] − lse))`` (lse itself unchanged;
    sink −inf: no effect, +inf: o = 0). A row with nothing to attend gives o = 0, lse = +inf.

    Args:
        q: ``[T, h, 512]``.
        cache, extra_cache: V4 cache views ``[pages, page_size, 1, 584]`` (:func:`v4_cache_view`).
        indices, extra_indices: ``int32 [T, K]`` physical slots (page · page_size + row), −1 invalid.

    Returns:
        ``(o [T, h, 512], lse [T, h])`` in ``compute_dtype``.
    """
    import torch

    cdt = compute_dtype or torch.float64
    t = q.shape[0]

    def source(c, idx, length):
        k = idx.shape[1]
        valid = idx >= 0
        if length is not None:
            valid &= torch.arange(k, device=idx.device)[None, :] < length.to(idx.device)[:, None]
        rows = dequantize_kv584(gather_kv584_rows(c, idx.clamp_min(0).reshape(-1)))
        return rows.view(t, k, 512).to(cdt), valid

    g, valid = source(cache, indices, topk_length)
    if extra_cache is not None:
        if extra_indices is None:
            raise ValueError("extra_cache needs extra_indices")
        g2, v2 = source(extra_cache, extra_indices, extra_topk_length)
        g, valid = torch.cat([g, g2], 1), torch.cat([valid, v2], 1)
    s = torch.einsum("thd,tkd->thk", q.to(cdt), g) * sm_scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("thk,tkd->thd", p, g)
    if attn_sink is not None:
        o = o * (1.0 / (1.0 + torch.exp(attn_sink.to(cdt)[None, : q.shape[1]] - lse)))[..., None]
    dead = torch.isneginf(lse)
    o = torch.where(dead[..., None], torch.zeros_like(o), o)
    lse = lse.masked_fill(dead, float("inf"))
    return o, lse
