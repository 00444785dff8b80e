"""GPU tests of the DeepSeek-V4 kernels at real shapes (marker ``gpu``; skipped without CUDA, failed when
``PDCTL_KERNELS_GPU=1`` and something is missing, as ``test_gpu.py``).

Fresh random data every run, outputs poisoned (NaN / −7) before each launch, the tolerances of
``pdctl.kernels._build`` (FlashMLA's rel 2.01/128 and cos-diff 5e-6, abs 1/64, rel Frobenius 1e-2, lse 1e-3; empty
rows o = 0, lse = +inf). FlashMLA (PyPI ``sgl-flash-mla`` 1.0.0) checks the 584-byte quantiser and the reference:
required when ``PDCTL_KERNELS_FLASHMLA=1`` (the device script installs it), skipped otherwise.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.gpu

_REQUIRED = os.environ.get("PDCTL_KERNELS_GPU") == "1"


def _unavailable(reason: str) -> None:
    if _REQUIRED:
        pytest.fail(f"PDCTL_KERNELS_GPU=1 but {reason}", pytrace=False)
    pytest.skip(f"{reason} (run on a GPU machine with PDCTL_KERNELS_GPU=1)", allow_module_level=True)


try:
    import torch
    import triton  # noqa: F401
except ImportError as exc:
    _unavailable(f"cannot import {exc.name}")
if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    _unavailable("no CUDA GPU with compiled Triton (TRITON_INTERPRET unset)")

from pdctl.kernels._build import (  # noqa: E402
    V4_SM_SCALE,
    _decode_tolerance_check,
    check_topk,
    make_indexer_case,
    make_v4_decode_case,
)
from pdctl.kernels._indexer import lightning_indexer  # noqa: E402
from pdctl.kernels._reference import (  # noqa: E402
    quantize_kv584,
    reference_indexer_logits,
    reference_sparse_decode_v4,
    v4_cache_view,
)
from pdctl.kernels._sparse_mla import DecodeConfig, sparse_decode_v4  # noqa: E402


def _flash_mla():
    try:
        import flash_mla
    except Exception as e:  # noqa: BLE001
        if os.environ.get("PDCTL_KERNELS_FLASHMLA") == "1":
            pytest.fail(f"PDCTL_KERNELS_FLASHMLA=1 but flash_mla does not import: {e!r}", pytrace=False)
        pytest.skip("sgl-flash-mla 1.0.0 not installed")
    return flash_mla


def _check(case, config=None):
    h, rows = case["q"].shape[1], case["q"].shape[0]
    ro, rl = reference_sparse_decode_v4(sm_scale=V4_SM_SCALE, compute_dtype=torch.float32, **case)
    o = torch.full((rows, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((rows, h), float("nan"), device="cuda")
    sparse_decode_v4(sm_scale=V4_SM_SCALE, out=o, lse=lse, config=config, **case)
    err = _decode_tolerance_check(o, lse, ro, rl)
    assert err["ok"], err
    return o, lse


@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("heads", [8, 16, 32, 64])
def test_v4_decode_matches_the_reference_at_c4_layer_shapes(heads, rows):
    _check(make_v4_decode_case(heads, rows, topk=512, slots=1 << 16))


@pytest.mark.parametrize("config", [
    DecodeConfig(16, 32, 4, 2, splits=1), DecodeConfig(16, 16, 4, 2, splits=7), DecodeConfig(32, 32, 8, 2, splits=5),
    DecodeConfig(64, 32, 8, 2, splits=3), DecodeConfig(16, 32, 4, 2, splits=8, bf16_partials=1),
    DecodeConfig(16, 64, 8, 2, splits=4, pdl=1), DecodeConfig(32, 32, 4, 2, splits=16, pdl=2),
], ids=lambda c: f"bh{c.block_h}-bn{c.block_n}-w{c.num_warps}-s{c.splits}-p{c.pdl}-b{c.bf16_partials}")
def test_v4_decode_configs_compute_the_same_function(config):
    _check(make_v4_decode_case(40, 9, topk=1024, slots=1 << 15), config)


def test_v4_decode_of_swa_only_and_c128_layers():
    # compress_ratio 0 layers: the window alone, no lengths; c128 layers: every compressed row of 2-row pages.
    case = make_v4_decode_case(16, 8, topk=512, slots=1 << 14)
    _check({**case, "extra_cache": None, "extra_indices": None, "extra_topk_length": None, "topk_length": None})
    c128 = make_v4_decode_case(16, 8, topk=1024, extra_page=2, slots=1 << 14)
    _check(c128)


@pytest.mark.parametrize("heads", [64, 16])
def test_flashmla_v4_agrees_with_the_quantiser_and_the_reference(heads):
    # FlashMLA reads our 584-byte pages: its output matching the reference checks the layout and the semantics
    # (two sources, lengths, −1, sinks of ±inf, the empty row). h = 16 is padded to 64 as SGLang pads.
    fm = _flash_mla()
    case = make_v4_decode_case(heads, 8, topk=512, slots=1 << 15)
    ro, rl = reference_sparse_decode_v4(sm_scale=V4_SM_SCALE, compute_dtype=torch.float32, **case)
    qp = torch.zeros(8, 1, 64, 512, dtype=torch.bfloat16, device="cuda")
    qp[:, 0, :heads] = case["q"]
    sink = torch.zeros(64, device="cuda")
    sink[:heads] = case["attn_sink"]
    out, lse = fm.flash_mla_with_kvcache(
        qp, case["cache"], None, None, 512, fm.get_mla_metadata()[0], softmax_scale=V4_SM_SCALE, is_fp8_kvcache=True,
        indices=case["indices"].view(8, 1, -1), attn_sink=sink, extra_k_cache=case["extra_cache"],
        extra_indices_in_kvcache=case["extra_indices"].view(8, 1, -1), topk_length=case["topk_length"],
        extra_topk_length=case["extra_topk_length"], use_legacy=True, kv_format="V4")
    err = _decode_tolerance_check(out[:, 0, :heads], lse[:, :heads, 0], ro, rl)
    assert err["ok"], err


def test_v4_cache_round_trips_through_flashmla_pages_of_256():
    # The SWA cache's 256-token pages (149760 B, padded to 576) with a window read at page boundaries.
    buf = quantize_kv584(torch.randn(4 * 256, 512, device="cuda"), 256)
    assert buf.shape == (4, 149760)
    view = v4_cache_view(buf, 256)
    idx = torch.tensor([[255, 256, 511, 512, 767, 768, 1023, -1] * 16], dtype=torch.int32, device="cuda")
    q = (torch.randn(1, 8, 512, device="cuda") * 0.5).bfloat16()
    case = {"q": q, "cache": view, "indices": idx, "topk_length": None, "attn_sink": None, "extra_cache": None,
            "extra_indices": None, "extra_topk_length": None}
    _check(case)


@pytest.mark.parametrize("topk", [512, 1024])
def test_v4_indexer_over_compressed_rows_matches_the_reference_at_1m_context(topk):
    # c4 page tables for a 1M-token context: 4096 pages of 64 compressed rows; lengths around top-k and one long row.
    lens = [1, topk - 1, topk, topk + 1, 2047, 32768]
    q8, w, cache, bt, sl = make_indexer_case(lens, max_context=1048576 // 4)
    out = torch.full((len(lens), topk), -7, dtype=torch.int32, device="cuda")
    lightning_indexer(q8, w, cache, bt, sl, topk, out=out)
    ref = reference_indexer_logits(q8, w, cache, bt, sl, compute_dtype=torch.float32)
    res = check_topk(out, ref, bt, sl, topk)
    assert res["ok"], res
    narrow = torch.full_like(out, -7)  # the same requests under a 128K-token page table
    lightning_indexer(q8, w, cache, bt[:, : 131072 // 4 // 64].contiguous(), sl, topk, out=narrow)
    assert torch.equal(out.sort(1).values, narrow.sort(1).values)
