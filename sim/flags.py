"""SGLang 0.5.23's ``launch_server`` command line, rebuilt from data.

Behaviour mirrored from SGLang 0.5.23:

* ``sglang/srt/server_args.py`` (``ServerArgs.add_cli_args``): the argparse parser.  Every option
  string, dest, nargs, choices, default, type and action comes from ``data/launch_server_flags.json``,
  a dump of that parser, so an unknown or removed flag (``--disaggregation-decode-tp``,
  ``--nsa-prefill-backend``) fails with argparse's "unrecognized arguments" and exit status 2, and an
  invalid choice fails with exit status 2 too.
* ``sglang/srt/utils/common.py``: the argparse ``type`` helpers (``human_readable_int``,
  ``nullable_str``, ``json_list_type``) and ``kill_process_tree``.
* ``sglang/srt/arg_groups/pd_disaggregation_hook.py``: the prefill server refuses the ``fake``
  transfer backend with an ``AssertionError("Prefill server does not support 'fake' as the transfer
  backend")`` raised at start-up (non-zero exit).
* ``sglang/srt/arg_groups/fields/*``: a few resolved values reported by ``/server_info`` (page size,
  served model name, context length, ``attn_dp_size`` folded from ``--enable-dp-attention``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from decimal import Decimal
from importlib import resources
from typing import Any

FLAGS_RESOURCE = "launch_server_flags.json"


def load_flag_table() -> dict[str, Any]:
    """The dumped SGLang 0.5.23 parser (package data ``data/launch_server_flags.json``)."""
    text = resources.files(__package__).joinpath("data", FLAGS_RESOURCE).read_text(encoding="utf-8")
    return json.loads(text)


# --- argparse ``type`` helpers, as in sglang/srt/utils/common.py -----------------------------------


def human_readable_int(value: str) -> int:
    value = value.strip()
    si = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    iec = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value)
    if match:
        number, suffix = match.groups()
        if suffix in iec:
            if "." in number:
                raise argparse.ArgumentTypeError(
                    f"Decimals are not allowed with IEC suffixes like '{suffix}'."
                )
            return int(number) * iec[suffix]
        result = Decimal(number) * si[suffix]
        if result != result.to_integral_value():
            raise argparse.ArgumentTypeError(f"'{value}' does not resolve to an integer.")
        return int(result)
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"Invalid integer value: '{value}'") from None


def nullable_str(val: str) -> str | None:
    if not val or val == "None":
        return None
    return val


def json_list_type(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"Invalid JSON list: {value}. Please provide a valid JSON list."
        ) from None


def loads(value: str) -> Any:
    return json.loads(value)


def parse_cuda_graph_backend_arg(raw: str) -> str:
    if raw == "tc_piecewise":
        raise argparse.ArgumentTypeError("tc_piecewise was removed; select breakable, full, or disabled")
    return raw


def parse_cuda_graph_config_arg(raw: str) -> dict:
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--cuda-graph-config must be JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(
            f"--cuda-graph-config must be a JSON object, got {type(parsed).__name__}"
        )
    return parsed


_TYPES: dict[str | None, Any] = {
    None: None,
    "str": str,
    "int": int,
    "float": float,
    "loads": loads,
    "human_readable_int": human_readable_int,
    "json_list_type": json_list_type,
    "nullable_str": nullable_str,
    "parse_cuda_graph_backend_arg": parse_cuda_graph_backend_arg,
    "parse_cuda_graph_config_arg": parse_cuda_graph_config_arg,
}


class _DeprecatedStoreTrue(argparse.Action):
    """``DeprecatedStoreTrueAction``: store True and warn (SGLang logs a deprecation warning)."""

    def __init__(self, option_strings, dest, default=False, required=False, help=None):
        super().__init__(option_strings, dest, nargs=0, const=True, default=default,
                         required=required, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"WARNING: {option_string} is deprecated.", file=sys.stderr)
        setattr(namespace, self.dest, True)


class _DeprecatedStoreConst(argparse.Action):
    """``DeprecatedStoreConstAction`` (``--monokernel-backend {amd}``): takes a choice, stores True."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"WARNING: {option_string} is deprecated.", file=sys.stderr)
        setattr(namespace, self.dest, True)


class _LoRAPath(argparse.Action):
    """``LoRAPathAction``: ``name=path`` or ``path`` items, kept as given."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, list(values or []))


def build_parser(table: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """An argparse parser equivalent to SGLang 0.5.23's ``launch_server`` parser."""
    table = table or load_flag_table()
    parser = argparse.ArgumentParser(prog=table.get("program", "python -m sglang.launch_server"))
    for arg in table["arguments"]:
        flags = arg["flags"]
        action = arg["action"]
        kwargs: dict[str, Any] = {"dest": arg["dest"], "default": arg["default"]}
        if action == "_StoreTrueAction":
            kwargs["action"] = "store_true"
        elif action == "BooleanOptionalAction":
            kwargs["action"] = argparse.BooleanOptionalAction
            flags = [f for f in flags if not f.startswith("--no-")]
        elif action == "DeprecatedStoreTrueAction":
            kwargs["action"] = _DeprecatedStoreTrue
        elif action == "DeprecatedStoreConstAction":
            kwargs["action"] = _DeprecatedStoreConst
            kwargs["choices"] = arg["choices"]
        elif action == "LoRAPathAction":
            kwargs["action"] = _LoRAPath
            kwargs["nargs"] = arg["nargs"]
            kwargs["type"] = _TYPES[arg["type"]]
        elif action == "_StoreAction":
            if arg["type"] is not None:
                kwargs["type"] = _TYPES[arg["type"]]
            if arg["nargs"] is not None:
                kwargs["nargs"] = arg["nargs"]
            if arg["choices"] is not None:
                kwargs["choices"] = arg["choices"]
            if arg.get("required"):
                kwargs["required"] = True
        else:  # pragma: no cover - the table only holds the actions above
            raise ValueError(f"unsupported argparse action in flag table: {action}")
        parser.add_argument(*flags, **kwargs)
    return parser


class StartupError(Exception):
    """A start-up refusal SGLang raises after parsing (the process exits non-zero)."""


def validate(args: argparse.Namespace) -> None:
    """Post-parse checks SGLang 0.5.23 makes before it starts (the ones the stand-in can see)."""
    if args.disaggregation_mode == "prefill" and args.disaggregation_transfer_backend == "fake":
        # arg_groups/pd_disaggregation_hook.py
        raise StartupError("AssertionError: Prefill server does not support 'fake' as the transfer backend")


def resolve(args: argparse.Namespace, argv: list[str], default_page_size: int = 1) -> dict[str, Any]:
    """The resolved argument dict ``/server_info`` reports (``ServerArgs.resolved_dict()``).

    ``default_page_size`` is what the model's override resolves an unset ``--page-size`` to
    (``arg_groups/model_overrides/deepseek_v2.py``: 64 for DeepSeek DSA on CUDA; ``deepseek_v4.py``: 256;
    ``overrides.py`` ``_page_size_default``: 1 otherwise)."""
    d = dict(vars(args))
    if d.get("served_model_name") is None:
        d["served_model_name"] = d["model_path"]
    if d.get("tokenizer_path") is None:
        d["tokenizer_path"] = d["model_path"]
    if d.get("enable_dp_attention") and d.get("attn_dp_size", 1) == 1:
        # parallel_hook._handle_deprecated_dp_attention: `--dp-size N --enable-dp-attention` is the old
        # spelling of `--attn-dp-size N`; dp_size counts replicas again.
        d["attn_dp_size"] = d.get("dp_size", 1)
        d["dp_size"] = 1
    # ServerArgs.resolved_dict reports the deprecated flag as "an attention-DP width is configured".
    d["enable_dp_attention"] = int(d.get("attn_dp_size") or 1) > 1
    if d.get("page_size") is None:
        d["page_size"] = default_page_size
    if d.get("context_length") is None:
        d["context_length"] = 163840
    deprecated = {"qwen25": "qwen", "glm45": "glm"}  # _handle_deprecated_args (with a warning)
    if d.get("tool_call_parser") in deprecated:
        d["tool_call_parser"] = deprecated[d["tool_call_parser"]]
    if d.get("disaggregation_transfer_backend") == "mooncake_tcp":
        # arg_groups/pd_disaggregation_hook.handle_pd_disaggregation (0.5.15+): "mooncake_tcp" is mooncake with
        # MC_FORCE_TCP=1; server_args says "mooncake" from then on, and the ib devices are dropped
        d["disaggregation_transfer_backend"] = "mooncake"
        d["disaggregation_ib_device"] = None
    if d.get("disaggregation_mode") == "decode":
        # "Radix cache is disabled for decode server" unless decode radix cache is enabled.
        if not d.get("disaggregation_decode_enable_radix_cache"):
            d["disable_radix_cache"] = True
    # server_args.prepare_server_args: the CLI arguments joined with spaces (watermark config redacted)
    d["launch_command"] = _redact_watermark(argv)
    return d


def _redact_watermark(argv: list[str]) -> str:
    out, redact_next = [], False
    for a in argv:
        if redact_next:
            out.append("<redacted>")
            redact_next = False
        elif a == "--watermark-config":
            out.append(a)
            redact_next = True
        elif a.startswith("--watermark-config="):
            out.append("--watermark-config=<redacted>")
        else:
            out.append(a)
    return " ".join(out)


def parse(argv: list[str], default_page_size: int = 1) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Parse like SGLang (argparse exits 2 on errors), validate, and resolve."""
    parser = build_parser()
    args = parser.parse_args(argv)
    validate(args)
    return args, resolve(args, argv, default_page_size)
