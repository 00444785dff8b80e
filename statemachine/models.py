"""Model facts: what pdctl knows of a checkpoint's attention, KV cache and weights, for capacity and model rules.

Two sources, the first that answers:

* the checkpoint itself, when ``model.path`` is a local directory on the role's host: its ``config.json`` (the
  attention geometry) and ``model.safetensors.index.json`` (``metadata.total_size``: the weights' bytes), read
  through that host (:func:`read_local`);
* the built-in table (:data:`BUILTIN`), matched by the path's last component (``deepseek-ai/DeepSeek-V4-Flash``,
  ``/models/DeepSeek-V3.2``): each entry holds the config.json fields SGLang sizes the KV cache from, copied from the
  published config, the weights' size, and the source of every number.

Both go through one parser, :func:`facts_from_config`, which reads a config as SGLang 0.5.23 does
(``sglang/srt/configs/model_config.py``, ``ModelConfig._derive_model_shapes``): the architecture decides the
attention kind, and the kind decides what a token costs in the KV pool (:func:`kv_layer_bytes`; the pool's sizing
lives in :mod:`pdctl.statemachine.capacity`).

Attention kinds, with what one token costs per layer (SGLang 0.5.23, ``model_executor/pool_configurator.py``):

* ``mla`` (DeepSeek-V3, R1, V3.1): one latent row of ``kv_lora_rank + qk_rope_head_dim`` (512 + 64) elements per
  layer, replicated on every attention-TP rank (``DefaultPoolConfigurator._compute_cell_size``): 1152 B in bf16,
  576 B in fp8;
* ``mla+dsa`` (DeepSeek-V3.2, V3.2-Exp): the same latent, in fp8 as the scaled "FP8 with scale" layout of
  ``calculate_mla_kv_cache_dim`` (``mem_cache/kv_cache_configurator.py``: 512 fp8 + 512/128 × 4 B scales + 64 bf16
  rope = 656 B), plus the lightning indexer's K cache, ``index_head_dim + index_head_dim/128 × 4`` = 132 B in uint8
  (``_compute_dsa_indexer_cell_size``, ``DSATokenToKVPool.quant_block_size = 128``) on every layer that computes
  top-k (all 61 of V3.2: ``dsa_layer_skips_topk`` with no ``index_topk_freq``);
* ``dsv4`` (DeepSeek-V4 Flash / Pro): a 128-token sliding-window (SWA) pool on every layer, ratio-4 compressed rows
  plus the indexer's rows on the CSA layers and ratio-128 rows on the HCA layers (``compress_ratios``), sized by
  ``DSV4PoolConfigurator``: rows of the FlashMLA "V4" layout, 448 fp8 + 64 bf16 + 8 scale bytes = 584 B, padded per
  page to 576-byte multiples (``sglang/kernels/ops/attention/dsv4/kv_layout.py``, ``KVLayout.V4``; the default
  ``SGLANG_DSV4_KV_LAYOUT=v4``), whatever ``--kv-cache-dtype`` says on CUDA;
* ``gqa`` (Llama, Qwen…): ``2 × kv_heads × head_dim`` elements per layer, the heads split over attention TP
  (``get_num_kv_heads``: ``max(1, kv_heads // tp)``);
* ``swa-hybrid`` (gpt-oss…): GQA on full layers plus a sliding-window pool on the others, that pool sized at
  ``swa_full_tokens_ratio`` (default 0.8) of the full one (``HybridSWAPoolConfigurator``).

What SGLang 0.5.23 supports for each in PD (:class:`PdSupport`): prefill and decode with different TP sizes work for
the ``mla``, ``mla+dsa`` and ``dsv4`` pools (``disaggregation/utils.py`` ``is_mla_backend``: ``MLATokenToKVPool`` and
``DeepSeekV4TokenToKVPool``; every rank holds the whole latent), work with a "Performance is NOT guaranteed" warning
for plain GQA (``disaggregation/common/conn.py``), and fail on the first transfer for non-MLA sliding-window hybrids
(``disaggregation/nixl/conn.py`` and ``mooncake/conn.py``: "PD Disaggregation does NOT support PD different TP sizes
for non-MLA SWA hybrid models yet"; sgl-project/sglang#38552).
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # pragma: no cover
    from pdctl.statemachine.hosts import Host

__all__ = [
    "BUILTIN",
    "DEPRECATED_ATTENTION_BACKENDS",
    "DEPRECATED_FLAGS",
    "DEPRECATED_TOOL_CALL_PARSERS",
    "ModelFacts",
    "ModelFactsError",
    "PdSupport",
    "builtin_facts",
    "facts_for",
    "facts_from_config",
    "kv_layer_bytes",
    "read_local",
    "resolve_kv_dtype",
]

Attention = Literal["mla", "mla+dsa", "dsv4", "gqa", "swa-hybrid"]

SGLANG = "SGLang 0.5.23"


class ModelFactsError(ValueError):
    """A config pdctl cannot read the attention of (an architecture it does not know, a field missing)."""


# --- kv-cache dtypes --------------------------------------------------------------------------------------------
# --kv-cache-dtype choices (data/sglang-0.5.23-flags.json) -> bytes of one stored element; "auto" is the model's dtype
# (SGLang 0.5.23 ModelRunner: kv_cache_dtype auto -> model dtype), except for DeepSeek-V4, where auto is fp8_e4m3
# (arg_groups/overrides.py, _deepseek_v4_kv_cache_dtype). fp4 dtypes are sized by recipe-specific scale layouts that
# pdctl does not model: they have no entry.
_ELEMENT_BYTES = {"fp8_e4m3": 1, "fp8_e5m2": 1, "mxfp8": 1, "bf16": 2, "bfloat16": 2, "float16": 2, "fp16": 2,
                  "float32": 4}
_TORCH_DTYPE_KV = {"bfloat16": "bf16", "float16": "float16", "float32": "float32"}


def resolve_kv_dtype(facts: ModelFacts, dtype: str | None) -> str:
    """The kv-cache dtype a server of *facts* runs with when given *dtype* (``auto``/None: the model's own, V4's
    fp8_e4m3); ``bfloat16`` and ``bf16`` are one dtype, spelled ``bf16`` here."""
    if dtype in (None, "auto"):
        return facts.default_kv_dtype
    return "bf16" if dtype == "bfloat16" else dtype


# --- deprecated names SGLang 0.5.23 still accepts -----------------------------------------------------------------
DEPRECATED_TOOL_CALL_PARSERS: dict[str, str] = {"qwen25": "qwen", "glm45": "glm"}
"""``--tool-call-parser`` aliases SGLang 0.5.23 rewrites with a warning (``arg_groups/serving_hook.py``,
``handle_deprecated_args``: "The tool_call_parser '…' is deprecated. Please use '…' instead")."""

DEPRECATED_ATTENTION_BACKENDS: dict[str, str] = {"nsa": "dsa", "compressed": "dsv4", "tokenspeed_mla": "cutedsl_mla"}
"""``--attention-backend`` choices marked "Deprecated alias" in SGLang 0.5.23 ``arg_groups/choices.py``."""

DEPRECATED_FLAGS: dict[str, str] = {
    "--disable-cuda-graph": "--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled",
    "--enable-dp-attention": "--attn-dp-size N (pdctl: attn_dp)",
    "--monokernel-backend": "--enable-amd-monokernel",
    "--enable-flashinfer-allreduce-fusion": "--flashinfer-allreduce-fusion-backend auto",
    "--disable-fast-image-processor": "--image-processor-backend pil",
    "--grpc-mode": "--smg-grpc-mode",
}
"""Launch flags SGLang 0.5.23 still parses but deprecates, with what to write instead: ``server_args.py`` ("Deprecated
argument registrations": ``--disable-cuda-graph``, ``--enable-dp-attention``, ``--monokernel-backend``,
``--enable-flashinfer-allreduce-fusion``), ``arg_groups/fields/mm.py`` (``--disable-fast-image-processor``) and
``arg_groups/fields/serving.py`` (``--grpc-mode``: "Deprecated, use --smg-grpc-mode")."""


# --- the facts ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PdSupport:
    """What SGLang 0.5.23 supports for a model kind in PD disaggregation (see the module docstring)."""

    hetero_tp: Literal["yes", "warn", "no"]
    """Prefill and decode with different TP sizes: ``yes``; ``warn`` (works, "Performance is NOT guaranteed");
    ``no`` (the first transfer raises)."""
    hetero_tp_source: str
    page_size: int | None
    """The page size SGLang forces on CUDA (None: any; it must still match on prefill and decode)."""
    page_size_source: str
    kv_dtypes: tuple[str, ...]
    """The kv-cache dtypes the model starts with (``auto`` included); empty: not restricted by pdctl's knowledge."""
    kv_dtypes_source: str


@dataclass(frozen=True)
class ModelFacts:
    """One checkpoint's facts. Sizes in bytes; ``sources`` names where each number comes from (field -> source)."""

    name: str
    """The table entry's name, or the local directory read."""
    architecture: str
    attention: Attention
    num_layers: int
    max_context: int
    """SGLang's derived context length (``get_context_length``: ``max_position_embeddings`` with a yarn rope's
    ``original_max_position_embeddings`` not multiplied): a longer ``--context-length`` stops the server at start."""
    model_dtype: str
    weights_bytes: int | None
    """The checkpoint's weights as SGLang loads them (the main model; an MTP/NextN head is loaded only with
    speculative decoding). None: unknown."""
    origin: str
    """``built-in table`` or ``config.json at HOST:PATH``."""
    # MLA / DSA
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    index_head_dim: int = 0
    indexer_layers: int = 0
    # GQA / SWA hybrid
    num_kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int | None = None
    swa_layers: int = 0
    full_layers: int = 0
    # DeepSeek-V4
    qk_nope_head_dim: int = 0
    num_attention_heads: int = 0
    """Query heads (V4: split over attention TP, ``n_local_heads = num_attention_heads // attn_tp_size``,
    SGLang 0.5.23 ``models/deepseek_v4.py``). 0: unknown."""
    index_topk: int = 0
    """Compressed rows the V4 indexer selects per request (``index_topk``: 512 Flash, 1024 Pro). 0: unknown."""
    compress_ratios: tuple[int, ...] = ()
    kv_source_layer_ids: tuple[int, ...] = ()
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def family(self) -> str:
        """The kind in words, for people."""
        return {
            "mla": "MLA (DeepSeek-V3 family)",
            "mla+dsa": "MLA with DeepSeek sparse attention (lightning-indexer K cache)",
            "dsv4": "DeepSeek-V4 compressed attention (sliding window + ratio-4/128 compressed rows + indexer)",
            "gqa": "GQA",
            "swa-hybrid": "sliding-window hybrid (GQA full + SWA layers)",
        }[self.attention]

    @property
    def default_kv_dtype(self) -> str:
        """What ``--kv-cache-dtype auto`` means for this model."""
        return "fp8_e4m3" if self.attention == "dsv4" else self.model_dtype

    @property
    def pd(self) -> PdSupport:
        """What SGLang 0.5.23 supports for this model in PD."""
        hetero = ("yes", f"{SGLANG} disaggregation/utils.py is_mla_backend (MLATokenToKVPool, DeepSeekV4TokenToKVPool): "
                         "every attention-TP rank holds the whole latent")
        if self.attention == "gqa":
            hetero = ("warn", f"{SGLANG} disaggregation/common/conn.py: 'Performance is NOT guaranteed when using "
                              "different TP sizes for non-MLA models'")
        elif self.attention == "swa-hybrid":
            hetero = ("no", f"{SGLANG} disaggregation/nixl/conn.py, mooncake/conn.py: 'PD Disaggregation does NOT "
                            "support PD different TP sizes for non-MLA SWA hybrid models yet' (sgl-project/sglang#38552)")
        page: tuple[int | None, str] = (None, f"{SGLANG} arg_groups/overrides.py _page_size_default: 1 unless the "
                                              "attention backend needs another")
        if self.attention == "dsv4":
            page = (256, f"{SGLANG} arg_groups/model_overrides/deepseek_v4.py: page_size = 256 on CUDA")
        elif self.attention == "mla+dsa":
            page = (64, f"{SGLANG} arg_groups/model_overrides/deepseek_v2.py: 'Setting page size to 64 for "
                        "DeepSeek DSA' (64 × index_kpool)")
        dtypes: tuple[tuple[str, ...], str] = ((), "")
        if self.attention == "dsv4":
            dtypes = (("auto", "fp8_e4m3", "bfloat16"), f"{SGLANG} arg_groups/overrides.py _deepseek_v4_kv_cache_dtype "
                                                        "(asserts fp8_e4m3 or bfloat16)")
        return PdSupport(hetero[0], hetero[1], page[0], page[1], dtypes[0], dtypes[1])  # type: ignore[arg-type]

    def to_json(self) -> dict[str, Any]:
        """The facts as data (``pdctl capacity --json``)."""
        pd = self.pd
        out: dict[str, Any] = {
            "name": self.name, "architecture": self.architecture, "attention": self.attention, "family": self.family,
            "num_layers": self.num_layers, "max_context": self.max_context, "model_dtype": self.model_dtype,
            "default_kv_dtype": self.default_kv_dtype, "weights_bytes": self.weights_bytes, "origin": self.origin,
            "kv_bytes_per_token_per_layer": {d: kv_layer_bytes(self, d) for d in self.kv_dtypes_known()},
            "pd": {"hetero_tp": pd.hetero_tp, "page_size": pd.page_size, "kv_dtypes": list(pd.kv_dtypes)},
            "sources": dict(self.sources),
        }
        if self.attention == "dsv4":
            out["layers_by_ratio"] = {str(r): n for r, n in sorted(self.layers_by_ratio().items())}
        return out

    def kv_dtypes_known(self) -> tuple[str, ...]:
        """The kv-cache dtypes pdctl can size a pool in for this model."""
        if self.attention == "dsv4":
            return ("fp8_e4m3",)  # (the V4 layout whatever the dtype, on CUDA)
        if self.attention == "mla+dsa":
            return ("bf16", "fp8_e4m3")
        return ("bf16", "fp8_e4m3")

    def layers_by_ratio(self) -> dict[int, int]:
        """DeepSeek-V4: how many layers own compressed storage of each ratio (4: CSA, 128: HCA; 1 and 2 only on
        ``kv_source_layer_ids``), as SGLang 0.5.23 ``collect_sources_by_ratio`` counts them; 0: SWA only."""
        out: dict[int, int] = {}
        for layer, ratio in enumerate(self.compress_ratios):
            if ratio in (1, 2) and layer not in self.kv_source_layer_ids:
                continue
            out[ratio] = out.get(ratio, 0) + 1
        return out


def kv_layer_bytes(facts: ModelFacts, dtype: str, *, attn_tp: int = 1) -> dict[str, float]:
    """Bytes one token costs in one layer's KV cache on one GPU, by kind of layer, for kv-cache *dtype* (``auto``
    taken as :meth:`ModelFacts.default_kv_dtype`) and attention-TP size *attn_tp* (only GQA heads split over it).
    Keys: ``latent`` (MLA), ``index`` (the DSA indexer), ``swa`` / ``c4`` / ``c128`` / ``c1`` / ``c2`` (DeepSeek-V4:
    the sliding window, and per full-pool token the compressed rows of each ratio with their indexer rows),
    ``full`` / ``sliding`` (GQA). Raises ModelFactsError for a dtype pdctl cannot size."""
    dtype = resolve_kv_dtype(facts, dtype)
    if facts.attention == "dsv4":
        # DSV4PoolConfigurator._get_paged_kv_bytes_per_token / _compressed_bytes_per_full_token (CUDA, V4 layout)
        return {k: v for k, v in _dsv4_per_layer(facts).items()}
    if dtype not in _ELEMENT_BYTES:
        raise ModelFactsError(f"pdctl cannot size a {dtype} KV cache (its scale layout is recipe-specific)")
    b = _ELEMENT_BYTES[dtype]
    if facts.attention in ("mla", "mla+dsa"):
        latent = float((facts.kv_lora_rank + facts.qk_rope_head_dim) * b)
        if facts.attention == "mla+dsa" and dtype == "fp8_e4m3":
            # calculate_mla_kv_cache_dim: kv_lora_rank + kv_lora_rank // 128 * 4 + rope dims in bf16 (2 B)
            latent = float(facts.kv_lora_rank + facts.kv_lora_rank // 128 * 4 + facts.qk_rope_head_dim * 2)
        out = {"latent": latent}
        if facts.attention == "mla+dsa":
            out["index"] = float(_dsa_index_bytes(facts.index_head_dim))
        return out
    heads = max(1, facts.num_kv_heads // max(attn_tp, 1))
    per = heads * (facts.head_dim + facts.v_head_dim) * b
    if dtype == "mxfp8":  # one e8m0 scale per 32 elements (pool_configurator.py, scale_block_size = 32)
        per += heads * (facts.head_dim + facts.v_head_dim) // 32
    return {"full": float(per)} if facts.attention == "gqa" else {"full": float(per), "sliding": float(per)}


def _dsa_index_bytes(index_head_dim: int) -> int:
    # _compute_dsa_indexer_cell_size: ceil_div(d + d // 128 * 4, index_kpool = 1) uint8 elements
    return index_head_dim + index_head_dim // 128 * 4


# DeepSeek-V4 pool geometry (SGLang 0.5.23, CUDA, defaults): the V4 layout and its page padding
# (kernels/ops/attention/dsv4/kv_layout.py: data 576 = 448 fp8 nope + 64 bf16 rope, scales 8, page_align 576),
# page_size 256 (model_overrides/deepseek_v4.py), the indexer rows (mem_cache/deepseek_v4_memory_pool.py
# get_dsv4_indexer_bytes_per_token: d + d // 128 * 4 for fp8, d // 2 + d // 32 for fp4), the compress-state rings
# (get_compress_state_ring_size without speculative decoding: 8 rows at ratio 4, 128 at ratio 128, 2 at ratio 2) and
# their fp32 state (SGLANG_DSV4_COMPRESS_STATE_DTYPE=float32).
DSV4_PAGE_SIZE = 256
_V4_ROW = 576 + 8
_V4_ALIGN = 576
DSV4_RING = {4: 8, 128: 128, 2: 2}
DSV4_STATE_BYTES = 4


def _v4_page_bytes_per_token(page_size: int) -> float:
    raw = page_size * _V4_ROW
    return -(-raw // _V4_ALIGN) * _V4_ALIGN / page_size


def _dsv4_per_layer(facts: ModelFacts) -> dict[str, float]:
    idx = facts.index_head_dim + facts.index_head_dim // 128 * 4
    idx_fp4 = facts.index_head_dim // 2 + facts.index_head_dim // 32
    out = {"swa": _v4_page_bytes_per_token(DSV4_PAGE_SIZE)}
    for ratio in sorted(facts.layers_by_ratio()):
        if ratio == 0:
            continue
        row = _v4_page_bytes_per_token(DSV4_PAGE_SIZE // ratio)
        if ratio == 4:
            out["c4"] = row / 4 + idx / 4
        elif ratio == 128:
            out["c128"] = row / 128
        else:  # ratios 1 and 2 (kv_source layers): fp4 indexer rows (V4 layout main rows on non-SM100)
            out[f"c{ratio}"] = (row + idx_fp4) / ratio
    return out


# --- reading a config -------------------------------------------------------------------------------------------
_MLA_ARCHS = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV2ForCausalLM", "KimiK25ForConditionalGeneration")
"""Architectures SGLang 0.5.23 runs on the MLA path (``model_config.py``: ``attention_arch = AttentionArch.MLA``)."""
_DSA_ARCHS = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
"""Architectures that are DSA when their config has ``index_topk`` (``model_config.py is_deepseek_dsa``)."""
_V4_ARCHS = ("DeepseekV4ForCausalLM",)


def _get(config: dict[str, Any], key: str, *, where: str) -> Any:
    if key not in config or config[key] is None:
        raise ModelFactsError(f"{where}: config.json has no {key!r}, which pdctl sizes the KV cache from")
    return config[key]


def _context_length(config: dict[str, Any]) -> int:
    """``get_context_length`` (SGLang 0.5.23 ``utils/hf_transformers/common.py``): the first of its keys, times a
    rope-scaling factor unless the scaling carries ``original_max_position_embeddings`` or is llama3's."""
    rope = config.get("rope_scaling") or {}
    factor = rope.get("factor", 1) if rope else 1
    if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3":
        factor = 1
    for key in ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings"):
        if config.get(key) is not None:
            return int(factor * config[key])
    return 2048


def facts_from_config(config: dict[str, Any], *, name: str, origin: str, weights_bytes: int | None = None,
                      sources: dict[str, str] | None = None) -> ModelFacts:
    """The facts of a checkpoint from its config.json *config* (a vision-language config's ``text_config`` is read
    for its language model). Raises ModelFactsError for an architecture pdctl does not know or a missing field."""
    if isinstance(config.get("text_config"), dict) and "num_hidden_layers" not in config:
        config = {**config["text_config"], "architectures": config.get("architectures")}
    archs = config.get("architectures") or []
    arch = archs[0] if archs else str(config.get("model_type") or "?")
    where = name
    layers = int(_get(config, "num_hidden_layers", where=where))
    dtype = _TORCH_DTYPE_KV.get(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), "bf16")
    common = dict(name=name, architecture=arch, num_layers=layers, max_context=_context_length(config),
                  model_dtype=dtype, weights_bytes=weights_bytes, origin=origin, sources=dict(sources or {}))
    if arch in _V4_ARCHS or config.get("model_type") in ("deepseek_v4", "deepseek_v41"):
        rope = int(_get(config, "qk_rope_head_dim", where=where))
        ratios = tuple(int(r) for r in _get(config, "compress_ratios", where=where))[:layers]
        if len(ratios) < layers:
            raise ModelFactsError(f"{where}: compress_ratios lists {len(ratios)} layers of {layers}")
        return ModelFacts(attention="dsv4", qk_rope_head_dim=rope,
                          qk_nope_head_dim=int(_get(config, "head_dim", where=where)) - rope,
                          head_dim=int(config["head_dim"]), sliding_window=int(_get(config, "sliding_window",
                                                                                     where=where)),
                          index_head_dim=int(_get(config, "index_head_dim", where=where)), compress_ratios=ratios,
                          num_attention_heads=int(config.get("num_attention_heads") or 0),
                          index_topk=int(config.get("index_topk") or 0),
                          kv_source_layer_ids=tuple(int(x) for x in config.get("kv_source_layer_ids") or ()),
                          **common)  # type: ignore[arg-type]
    if arch in _MLA_ARCHS and config.get("kv_lora_rank") is not None:
        dsa = arch in _DSA_ARCHS and config.get("index_topk") is not None
        facts = ModelFacts(attention="mla+dsa" if dsa else "mla", kv_lora_rank=int(config["kv_lora_rank"]),
                           qk_rope_head_dim=int(_get(config, "qk_rope_head_dim", where=where)),
                           **common)  # type: ignore[arg-type]
        if dsa:
            freq = int(config.get("index_topk_freq") or 1)
            # dsa_layer_skips_topk: layer l computes top-k when max(l - 1, 0) % freq == 0 (no pattern, no offset)
            skipping = sum(1 for layer in range(layers) if max(layer - 1, 0) % freq != 0)
            facts = replace(facts, index_head_dim=int(_get(config, "index_head_dim", where=where)),
                            indexer_layers=layers - skipping)
        return facts
    heads = int(_get(config, "num_attention_heads", where=where))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(_get(config, "hidden_size", where=where)) // heads)
    types = list(config.get("layer_types") or [])[:layers]
    sliding = sum(1 for t in types if t == "sliding_attention")
    if sliding and config.get("sliding_window"):
        return ModelFacts(attention="swa-hybrid", num_kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim,
                          sliding_window=int(config["sliding_window"]), swa_layers=sliding,
                          full_layers=layers - sliding, **common)  # type: ignore[arg-type]
    if kv_heads <= 0 or head_dim <= 0:
        raise ModelFactsError(f"{where}: {arch} has no attention heads pdctl can size")
    return ModelFacts(attention="gqa", num_kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim,
                      full_layers=layers, **common)  # type: ignore[arg-type]


# --- the built-in table -------------------------------------------------------------------------------------------
# Each entry: (name patterns on the path's last component, the config.json fields that size the KV cache, the
# weights' bytes, the source of every number). Regexes are matched case-insensitively, first match wins.
_HF = "https://huggingface.co"
_V4_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4, 0]  # 44 entries: 43 layers + the MTP layer's trailing 0
_V4_PRO_RATIOS = [128, 128] + [4, 128] * 29 + [4, 0]  # 62 entries: 61 layers + the MTP layer's trailing 0
_V4_CONFIG = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "head_dim": 512,
              "qk_rope_head_dim": 64, "num_key_value_heads": 1, "sliding_window": 128, "index_head_dim": 128,
              "max_position_embeddings": 1048576, "torch_dtype": "bfloat16",
              "rope_scaling": {"factor": 16, "original_max_position_embeddings": 65536, "type": "yarn"}}
_V3_CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
              "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
              "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
              "rope_scaling": {"factor": 40, "original_max_position_embeddings": 4096, "type": "yarn"}}

BUILTIN: tuple[tuple[tuple[str, ...], dict[str, Any], int | None, dict[str, str]], ...] = (
    (
        (r"deepseek-v4-flash",),
        {**_V4_CONFIG, "num_hidden_layers": 43, "compress_ratios": _V4_FLASH_RATIOS, "num_attention_heads": 64,
         "index_topk": 512},
        155_000_000_000,
        {
            "config": f"{_HF}/deepseek-ai/DeepSeek-V4-Flash/blob/main/config.json (43 layers, head_dim 512, "
                      "qk_rope_head_dim 64, sliding_window 128, index_head_dim 128, compress_ratios [0,0,4,128,…,4,0], "
                      "max_position_embeddings 1048576, yarn factor 16 over 65536, num_attention_heads 64, index_topk 512); "
                      "the same values are SGLang 0.5.23 configs/deepseek_v4.py DeepSeekV4Config's defaults",
            "weights_bytes": "≈155 GB, arithmetic from the config: 43 × 256 routed experts × 3 × 4096 × 2048 = 277.0 B "
                             "parameters in FP4 (e2m1 + one ue8m0 scale per 32: 0.53125 B) = 147.2 GB, ~5.7 B FP8 "
                             "attention/shared-expert parameters ≈ 5.8 GB, BF16 embeddings and head 2 × 129280 × 4096 "
                             "≈ 2.1 GB (DeepSeek-V4 model card: 284 B parameters, FP4 experts + FP8); the native "
                             "FP4/FP8 GGUF of it is ~146 GiB (huggingface.co/nsparks/DeepSeek-V4-Flash-FP4-FP8-GGUF)",
        },
    ),
    (
        (r"deepseek-v4-pro",),
        {**_V4_CONFIG, "num_hidden_layers": 61, "compress_ratios": _V4_PRO_RATIOS, "num_attention_heads": 128,
         "index_topk": 1024},
        848_000_000_000,
        {
            "config": f"{_HF}/deepseek-ai/DeepSeek-V4-Pro/blob/main/config.json (61 layers, compress_ratios "
                      "[128,128,4,128,…,4,0]: 30 CSA + 31 HCA layers, no SWA-only layer; head_dim 512, rope 64, "
                      "sliding_window 128, index_head_dim 128, max_position_embeddings 1048576, num_attention_heads 128, "
                      "index_topk 1024)",
            "weights_bytes": "≈848 GB, arithmetic from the config: 61 × 384 routed experts × 3 × 7168 × 3072 = "
                             "1547.4 B parameters in FP4 (0.53125 B) = 822.1 GB, ~22 B FP8 attention/shared "
                             "parameters, BF16 embeddings and head 2 × 129280 × 7168 ≈ 3.7 GB (model card: 1.6 T "
                             "parameters, FP4 experts + FP8)",
        },
    ),
    (
        (r"deepseek-v3[._-]?2",),
        {**_V3_CONFIG, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "index_topk": 2048,
         "index_head_dim": 128, "index_n_heads": 64},
        675_000_000_000,
        {
            "config": f"{_HF}/deepseek-ai/DeepSeek-V3.2/blob/main/config.json (61 layers, kv_lora_rank 512, "
                      "qk_rope_head_dim 64, index_head_dim 128, index_topk 2048, max_position_embeddings 163840; "
                      "shared/reference/kernels.md §2)",
            "weights_bytes": "≈675 GB: 671 B main-model parameters in FP8 with 128×128 FP32 block scales, BF16 "
                             "embeddings/head (+1.9 GB) and the indexer (~0.9 GB); the 14 B MTP module is not loaded "
                             "without speculative decoding (DeepSeek-V3 README: 685 B on HF = 671 B main + 14 B MTP; "
                             "shared/reference/sglang-pd.md §1.4: the FP8 checkpoint ≈ 690 GB with MTP)",
        },
    ),
    (
        (r"deepseek-v3", r"deepseek-r1(?!-distill)"),
        _V3_CONFIG,
        674_000_000_000,
        {
            "config": f"{_HF}/deepseek-ai/DeepSeek-V3/blob/main/config.json (61 layers, kv_lora_rank 512, "
                      "qk_rope_head_dim 64, max_position_embeddings 163840; R1, V3-0324 and V3.1 share it)",
            "weights_bytes": "≈674 GB: 671 B main-model parameters in FP8 with 128×128 FP32 block scales and BF16 "
                             "embeddings/head; the 14 B MTP module is not loaded without speculative decoding "
                             "(DeepSeek-V3 README: 685 B on HF = 671 B main + 14 B MTP)",
        },
    ),
    (
        (r"qwen3-235b-a22b",),
        {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 94,
         "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
         "torch_dtype": "bfloat16"},
        470_000_000_000,
        {
            "config": f"{_HF}/Qwen/Qwen3-235B-A22B/blob/main/config.json (94 layers, 64 heads, 4 KV heads, "
                      "head_dim 128, max_position_embeddings 40960)",
            "weights_bytes": "≈470 GB: 235 B parameters in BF16 (model card)",
        },
    ),
    (
        (r"gpt-oss-120b",),
        {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 36,
         "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
         "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
         "torch_dtype": "bfloat16"},
        65_000_000_000,
        {
            "config": f"{_HF}/openai/gpt-oss-120b/blob/main/config.json (36 layers alternating sliding_attention / "
                      "full_attention, sliding_window 128, 8 KV heads, head_dim 64, max_position_embeddings 131072)",
            "weights_bytes": "≈65 GB: 117 B parameters, MoE weights in MXFP4, the rest BF16 (model card: fits one "
                             "80 GB GPU)",
        },
    ),
)


def builtin_facts(model_path: str) -> ModelFacts | None:
    """The built-in table's facts for *model_path* (a Hugging Face id or a directory, matched by its last
    component), or None."""
    base = posixpath.basename(model_path.rstrip("/")).lower()
    for patterns, config, weights, sources in BUILTIN:
        if any(re.search(p, base) for p in patterns):
            src = {"num_layers": sources["config"], "attention": sources["config"], "max_context": sources["config"],
                   "weights_bytes": sources["weights_bytes"],
                   "kv_bytes": "SGLang 0.5.23 model_executor/pool_configurator.py (see pdctl.statemachine.models)"}
            return facts_from_config(config, name=posixpath.basename(model_path.rstrip("/")), origin="built-in table",
                                     weights_bytes=weights, sources=src)
    return None


def read_local(host: Host, path: str) -> ModelFacts:
    """The facts of the checkpoint in directory *path* on *host*: its ``config.json`` and, for the weights,
    ``model.safetensors.index.json``'s ``metadata.total_size`` (a single ``model.safetensors`` has no index: its
    weights stay unknown, as pdctl reads no shard). Raises OSError (via the host) for a missing config and
    ModelFactsError for one it cannot read."""
    where = f"{host.name}:{path}" if getattr(host, "name", None) else path
    text = host.read_text(posixpath.join(path, "config.json"))
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ModelFactsError(f"{where}/config.json is not JSON: {exc}") from None
    weights: int | None = None
    src = {"config": f"config.json at {where}"}
    try:
        index = json.loads(host.read_text(posixpath.join(path, "model.safetensors.index.json")))
        total = (index.get("metadata") or {}).get("total_size")
        if isinstance(total, (int, float)) and total > 0:
            weights = int(total)
            src["weights_bytes"] = f"model.safetensors.index.json metadata.total_size at {where}"
    except (OSError, ValueError, AttributeError):
        pass
    return facts_from_config(config, name=path, origin=f"config.json at {where}", weights_bytes=weights,
                             sources={"num_layers": src["config"], "attention": src["config"],
                                      "max_context": src["config"],
                                      "weights_bytes": src.get("weights_bytes", "unknown (no safetensors index)"),
                                      "kv_bytes": "SGLang 0.5.23 model_executor/pool_configurator.py"})


def facts_for(model_path: str, host: Host | None = None) -> ModelFacts | None:
    """The facts of *model_path*: read from the checkpoint on *host* when the path is absolute and a directory there
    with a config.json, else from the built-in table; None when neither knows it. A checkpoint whose config pdctl
    cannot read falls back to the table too (its name may still be known)."""
    if host is not None and model_path.startswith("/"):
        try:
            return read_local(host, model_path)
        except (OSError, ModelFactsError):
            pass
    return builtin_facts(model_path)


def weights_per_gpu(facts: ModelFacts, tp: int) -> float | None:
    """The weights one GPU of a TP group holds, bytes: all of them split over TP (MoE experts and dense layers are
    both sharded over TP in SGLang without EP; replicated norms and the like are small). None: weights unknown."""
    return None if facts.weights_bytes is None else facts.weights_bytes / max(tp, 1)


def human_tokens(n: float) -> str:
    """``6.33M``, ``512k``, ``850``: a token count in words."""
    if n >= 1_000_000:
        return f"{n / 1_000_000:.2f}M"
    if n >= 10_000:
        return f"{n / 1000:.0f}k"
    return f"{n:.0f}" if not math.isnan(n) else "?"
