"""What pdctl knows about each SGLang release it can target, as data.

Sources (see ``shared/reference`` of the project):

* SGLang 0.5.23's full argparse parser (``ServerArgs.add_cli_args``), dumped from its wheel into
  ``data/sglang-0.5.23-flags.json`` (531 arguments: option strings, dest, choices, defaults). The
  parser names are the ``choices`` of ``--reasoning-parser`` (``srt/parser/reasoning_parser_names.py``)
  and ``--tool-call-parser`` (``srt/function_call/parser_names.py``).
* SGLang 0.5.6's parser lists, its ``--nsa-*`` backend choices and its attention-DP spelling
  (``--dp-size N --enable-dp-attention``), read from its ``server_args.py``; its bootstrap ``/route`` query
  (``engine_rank``, ``target_dp_group``, ``target_pp_rank``) from ``disaggregation/common/conn.py``.
* Removed/renamed flags: ``--disaggregation-decode-tp``, ``--disaggregation-decode-dp`` and
  ``--disaggregation-prefill-pp`` exist in 0.5.6/0.5.9 and are gone by 0.5.12; ``--nsa-*`` became
  ``--dsa-*`` (aliases in 0.5.15-0.5.18, gone in 0.5.20).
* SGLang derives 6 ZMQ TCP ports at ``port+233 ... port+239`` with attention-DP and no
  ``--dist-init-addr`` (``ZMQ_TCP_PORT_DELTA = 233``).

Only this module reads the JSON; it is loaded lazily and cached.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

__all__ = [
    "DEFAULT_SGLANG_VERSION",
    "KNOWN_VERSIONS",
    "SglangFacts",
    "facts_for",
    "version_tuple",
]

DEFAULT_SGLANG_VERSION = "0.5.23"

ZMQ_TCP_PORT_DELTA = 233
"""SGLang 0.5.23 ``srt/utils``: attention-DP ZMQ ports start at ``port + 233``."""

DERIVED_PORT_OFFSETS = tuple(range(ZMQ_TCP_PORT_DELTA, ZMQ_TCP_PORT_DELTA + 7))
"""``port+233 … port+239`` (inclusive), reserved when attention-DP > 1."""

_REASONING_0_5_6 = (
    "deepseek-r1", "deepseek-v3", "glm45", "gpt-oss", "kimi", "kimi_k2", "qwen3",
    "qwen3-thinking", "minimax", "minimax-append-think", "step3",
)
_TOOL_0_5_6 = (
    "deepseekv3", "deepseekv31", "deepseekv32", "glm", "glm45", "gpt-oss", "kimi_k2", "llama3",
    "mistral", "pythonic", "qwen", "qwen25", "qwen3_coder", "step3", "minimax-m2",
)

_NSA_BACKENDS_0_5_6 = ("flashmla_sparse", "flashmla_kv", "flashmla_auto", "fa3", "tilelang", "aiter")
"""``--nsa-prefill-backend`` / ``--nsa-decode-backend`` choices of 0.5.6."""

# flag -> (first version without it, replacement or None)
_REMOVED_FLAGS: dict[str, tuple[str, str | None]] = {
    "--disaggregation-decode-tp": ("0.5.12", None),
    "--disaggregation-decode-dp": ("0.5.12", None),
    "--disaggregation-prefill-pp": ("0.5.12", None),
    "--nsa-prefill-backend": ("0.5.20", "--dsa-prefill-backend"),
    "--nsa-decode-backend": ("0.5.20", "--dsa-decode-backend"),
    "--enable-nsa-prefill-context-parallel": ("0.5.20", None),
}


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.5.23"`` → ``(0, 5, 23)``. Raises ValueError on anything else."""
    parts = version.strip().split(".")
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a release version: {version!r} (expected e.g. 0.5.23)")
    return tuple(int(p) for p in parts)


@dataclass(frozen=True)
class LaunchArgument:
    """One ``launch_server`` argument as argparse reads it (``data/sglang-0.5.23-flags.json``): its option strings,
    ``nargs`` (argparse's: None one value, 0 none, ``"?"``, ``"*"``, ``"+"``), ``choices`` (as strings) and the name
    of its ``type`` (``"int"``, ``"float"``, ``"str"``, a parser function's name, or None)."""

    flags: tuple[str, ...]
    nargs: int | str | None
    choices: tuple[str, ...] | None
    type: str | None

    @property
    def takes(self) -> tuple[int, int | None]:
        """``(fewest, most)`` values after the flag (most None: as many as follow)."""
        return {None: (1, 1), 0: (0, 0), "?": (0, 1), "*": (0, None), "+": (1, None)}.get(self.nargs, (0, None))


@dataclass(frozen=True)
class SglangFacts:
    """Facts about one SGLang release: flags, parser names, removed flags."""

    version: str
    reasoning_parsers: frozenset[str]
    tool_call_parsers: frozenset[str]
    flags: frozenset[str] | None
    """Every option string of ``launch_server`` when known (None: not recorded for this version)."""
    transfer_backends: frozenset[str]
    dsa_backends: tuple[frozenset[str], frozenset[str]]
    """The choices of the sparse-attention prefill and decode backends."""
    sparse_attention_prefix: str = "--dsa"
    """``--dsa`` (``--dsa-prefill-backend``…, 0.5.15+) or ``--nsa`` (0.5.6 – 0.5.12)."""
    decode_layout_on_prefill: bool = False
    """Prefill assumes decode's TP/DP are its own unless given ``--disaggregation-decode-tp/-dp`` (0.5.6; gone by
    0.5.12, where decode learns prefill's layout from the bootstrap server; shared/reference/sglang-pd.md §1.1)."""
    legacy_dp_attention: bool = False
    """Attention-DP spelled ``--dp-size N --enable-dp-attention`` (≤ 0.5.20), not ``--attn-dp-size N``."""
    choices: tuple[tuple[str, frozenset[str]], ...] = ()
    """``(flag, choices)`` of the launch flags pdctl renders from free-text spec fields (``--attention-backend``,
    ``--load-format``, ``--kv-cache-dtype``), "auto" included; empty where not recorded for this version."""
    arguments: tuple[LaunchArgument, ...] = ()
    """Every ``launch_server`` argument, with what it takes (:class:`LaunchArgument`); empty where not recorded."""
    bootstrap_route_query: tuple[tuple[str, str], ...] = (
        ("prefill_dp_rank", "-1"), ("prefill_cp_rank", "-1"), ("target_tp_rank", "-1"), ("target_pp_rank", "-1"),
    )
    """The query of the prefill bootstrap server's ``GET /route`` that answers with its parallel info
    (``disaggregation/common/conn.py``, ``try_ensure_parallel_info``)."""

    def argument(self, flag: str) -> LaunchArgument | None:
        """The argument *flag* (an option string, without ``=value``) names; None where unknown or not recorded."""
        return _arguments_by_flag(self.arguments).get(flag)

    def removed_flag(self, flag: str) -> tuple[str, str | None] | None:
        """``(removed_in, replacement)`` when *flag* no longer exists in this version."""
        name = flag.split("=", 1)[0]
        hit = _REMOVED_FLAGS.get(name)
        if hit is None and name.startswith("--nsa-"):
            hit = ("0.5.20", "--dsa-" + name[len("--nsa-"):])
        if hit is None:
            return None
        if version_tuple(self.version) >= version_tuple(hit[0]):
            return hit
        return None


@lru_cache(maxsize=None)
def _flags_0_5_23() -> dict:
    data = resources.files("pdctl.statemachine").joinpath("data/sglang-0.5.23-flags.json").read_text()
    return json.loads(data)


def _choices(dump: dict, flag: str, *, keep_auto: bool = False) -> frozenset[str]:
    for arg in dump["arguments"]:
        if flag in arg["flags"]:
            return frozenset(c for c in (arg.get("choices") or []) if keep_auto or c != "auto")
    raise KeyError(flag)


@lru_cache(maxsize=None)
def _arguments_by_flag(arguments: tuple[LaunchArgument, ...]) -> dict[str, LaunchArgument]:
    return {flag: arg for arg in arguments for flag in arg.flags}


def _launch_arguments(dump: dict) -> tuple[LaunchArgument, ...]:
    out = []
    for arg in dump["arguments"]:
        choices = tuple(str(c) for c in arg["choices"]) if arg.get("choices") else None
        out.append(LaunchArgument(tuple(arg["flags"]), arg["nargs"], choices, arg.get("type")))
    return tuple(out)


@lru_cache(maxsize=None)
def facts_for(version: str) -> SglangFacts:
    """Facts for *version*. Raises KeyError (with the known versions) for an unknown release."""
    if version == "0.5.23":
        dump = _flags_0_5_23()
        return SglangFacts(
            version=version,
            reasoning_parsers=_choices(dump, "--reasoning-parser"),
            tool_call_parsers=_choices(dump, "--tool-call-parser"),
            flags=frozenset(f for arg in dump["arguments"] for f in arg["flags"]),
            transfer_backends=_choices(dump, "--disaggregation-transfer-backend"),
            dsa_backends=(_choices(dump, "--dsa-prefill-backend"), _choices(dump, "--dsa-decode-backend")),
            choices=tuple((flag, _choices(dump, flag, keep_auto=True))
                          for flag in ("--attention-backend", "--load-format", "--kv-cache-dtype")),
            arguments=_launch_arguments(dump),
        )
    if version == "0.5.6":
        return SglangFacts(
            version=version,
            reasoning_parsers=frozenset(_REASONING_0_5_6),
            tool_call_parsers=frozenset(_TOOL_0_5_6),
            flags=None,
            transfer_backends=frozenset({"mooncake", "nixl", "ascend", "fake"}),
            dsa_backends=(frozenset(_NSA_BACKENDS_0_5_6), frozenset(_NSA_BACKENDS_0_5_6)),
            sparse_attention_prefix="--nsa",
            decode_layout_on_prefill=True,
            legacy_dp_attention=True,
            bootstrap_route_query=(("engine_rank", "-1"), ("target_dp_group", "-1"), ("target_pp_rank", "-1")),
        )
    raise KeyError(version)


KNOWN_VERSIONS = ("0.5.6", "0.5.23")
