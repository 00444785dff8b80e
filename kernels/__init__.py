"""pdctl.kernels — Triton kernels for DeepSeek sparse attention (DSA) decode, built and verified on the target GPU.

Two ops (spec: ``shared/reference/kernels.md``; conventions in ``_reference.py``):

* :func:`sparse_mla_decode` ``(q [T,h,576], kv [slots,576] bf16 | uint8 [slots,656] FP8, indices int32 [T,K],
  sm_scale, topk_length=None) -> (o [T,h,512], lse [T,h] fp32)`` — tensor-core split-K flash-decoding.
* :func:`lightning_indexer` ``(q8 e4m3 [B,64,128], weights fp32 [B,64], index_k_cache uint8 [pages,8448],
  block_table int32 [B,W], seq_lens int32 [B], topk=2048) -> int32 [B,topk]`` — O(Σ L_b) logits on a fixed
  persistent grid, exact top-k over L_b entries, physical slots out.

DeepSeek-V4 (SGLang's ``dsv4`` backend; same family, same build and plugin):

* :func:`sparse_decode_v4` ``(q [T,h,512], cache [pages,page,1,584], indices int32 [T,K1], sm_scale, topk_length=None,
  attn_sink=None, extra_cache=None, extra_indices=None, extra_topk_length=None) -> (o [T,h,512], lse [T,h])`` — the
  584-byte V4 cache, a second KV source (sliding window + compressed rows), per-head attention sink;
* the V4 indexer is :func:`lightning_indexer` over compressed rows (c4 index-K pages of 64 rows x 132 B, the
  page table of 256-token pages, ``compressed_seq_lens``), ``topk`` 512 (Flash) or 1024 (Pro).

Build step (``kernels_built``)::

    build_and_verify(cache_dir, *, heads=(16,), batch_sizes=(1, 8, 64), kv_formats=("fp8", "bf16"),
                     topk=2048, max_context=163840, indexer_seq_lens=(1, 2048, 2049, 8191, 40000),
                     tune=True, sm_scale=0.135234) -> dict   # manifest; raises KernelsBuildError

    python -m pdctl.kernels build --cache-dir DIR [--heads 16 32] [--batch-sizes 1 8 64]
                                  [--kv-formats fp8 bf16] [--max-context 163840] [--no-tune]
    python -m pdctl.kernels build --cache-dir DIR --model deepseek-v4 --heads 16 [--topk 512] [--max-context 1048576]
    # prints the manifest path; exit 0 verified, 2 cannot build here (no CUDA GPU), 1 verification failed

The manifest (``DIR/pdctl-kernels-manifest.json``) records GPU name/arch/SM count, torch/triton versions, the
chosen launch configs and the measured errors; Triton binaries go to ``DIR/triton``. SGLang integration:
``pdctl.kernels.sglang_plugin`` (entry point ``pdctl_kernels`` in group ``sglang.srt.plugins``).

Importing this package imports neither torch nor triton: every public name is resolved lazily (the core CLI
imports this package on machines without them). The package imports nothing else of pdctl.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "KernelsBuildError",
    "build_and_verify",
    "dequantize_kv584",
    "dequantize_kv656",
    "lightning_indexer",
    "load_manifest",
    "pack_index_k_cache",
    "quantize_kv584",
    "quantize_kv656",
    "reference_indexer_logits",
    "reference_lightning_indexer",
    "reference_sparse_decode_v4",
    "reference_sparse_mla_decode",
    "sparse_decode_v4",
    "sparse_mla_decode",
    "v4_cache_view",
]

_WHERE = {
    "KernelsBuildError": "_build",
    "build_and_verify": "_build",
    "load_manifest": "_build",
    "sparse_mla_decode": "_sparse_mla",
    "sparse_decode_v4": "_sparse_mla",
    "dequantize_kv584": "_reference",
    "quantize_kv584": "_reference",
    "reference_sparse_decode_v4": "_reference",
    "v4_cache_view": "_reference",
    "lightning_indexer": "_indexer",
    "dequantize_kv656": "_reference",
    "quantize_kv656": "_reference",
    "pack_index_k_cache": "_reference",
    "reference_indexer_logits": "_reference",
    "reference_lightning_indexer": "_reference",
    "reference_sparse_mla_decode": "_reference",
}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'pdctl.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
