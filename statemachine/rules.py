"""Topology rules: reject a broken PD deployment before anything starts.

``validate(dep)`` returns every :class:`Finding` (errors and warnings); ``check(dep)`` raises one
:class:`SpecError` listing all errors. Validation is pure: it reads only the spec (and an
inventory passed in by the caller), contacts no host and changes nothing.

Each finding names the spec field (``prefill[0].gpus``) and says how to fix it. Where a rule
comes from SGLang's behaviour, the docstring of the check names the SGLang 0.5.23 source.

Note on GPU counts: SGLang 0.5.23's ``--attn-dp-size`` is "the number of data-parallel attention
groups inside the TP group" (``launch_server --help``), so a server uses ``tp`` GPUs and
``attn_dp`` must divide ``tp``; it does not multiply the GPU count.
"""

from __future__ import annotations

import difflib
import functools
import ipaddress
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Literal

from pdctl.statemachine.errors import SpecError
from pdctl.statemachine.sglang_facts import DERIVED_PORT_OFFSETS, KNOWN_VERSIONS, facts_for
from pdctl.statemachine.spec import Deployment, ServerRole
from pdctl.statemachine.topology import is_wildcard, role_node, url_host
from pdctl.units import UNIT_DIR_ENV, UNIT_ENV, cpu_list, cpu_set

__all__ = ["Finding", "Inventory", "check", "validate"]

# SGLang launch flags pdctl sets itself from the spec; extra_args may not fight them.
_OWNED_SERVER_FLAGS: dict[str, str] = {
    "--host": "http_host",
    "--port": "port",
    "--nccl-port": "nccl_port",
    "--disaggregation-mode": "the role's kind ([[prefill]]/[[decode]]/[[server]])",
    "--disaggregation-bootstrap-port": "bootstrap_port",
    "--disaggregation-transfer-backend": "kv_transfer.backend",
    "--disaggregation-ib-device": "kv_transfer.ib_device",
    "--tp-size": "tp",
    "--tensor-parallel-size": "tp",
    "--tp": "tp",
    "--attn-dp-size": "attn_dp",
    "--attention-data-parallel-size": "attn_dp",
    "--enable-dp-attention": "attn_dp",
    "--ep-size": "ep",
    "--expert-parallel-size": "ep",
    "--ep": "ep",
    "--base-gpu-id": "gpus",
    "--gpu-id-step": "gpus",
    "--model-path": "model.path",
    "--model": "model.path",
    "--served-model-name": "model.served_name",
    "--page-size": "model.page_size",
    "--kv-cache-dtype": "model.kv_cache_dtype",
    "--context-length": "model.context_length",
    "--trust-remote-code": "model.trust_remote_code",
    "--load-format": "model.load_format",
    "--mem-fraction-static": "mem_fraction",
    "--reasoning-parser": "parsers.reasoning_parser",
    "--tool-call-parser": "parsers.tool_call_parser",
    "--chat-template": "parsers.chat_template",
    "--attention-backend": "model.attention_backend",
    "--dsa-prefill-backend": "model.dsa_prefill_backend",
    "--dsa-decode-backend": "model.dsa_decode_backend",
    "--nsa-prefill-backend": "model.dsa_prefill_backend",  # the names up to 0.5.12 (pdctl spells them per release)
    "--nsa-decode-backend": "model.dsa_decode_backend",
    "--enable-metrics": "(always on)",
}
_OWNED_ENV = {
    "CUDA_VISIBLE_DEVICES": "gpus",
    "CUDA_DEVICE_ORDER": "gpus (their ids are nvidia-smi's, so pdctl sets CUDA_DEVICE_ORDER=PCI_BUS_ID)",
    "SGLANG_CACHE_DIR": "engine.cache_dir",
    "SGLANG_PLUGINS": "kernels",
    "PDCTL_KERNELS_DIR": "kernels",
    "PDCTL_KERNELS_ROUTE": "kernels.which",
}
_SUPERVISOR_ENV = (UNIT_ENV, UNIT_DIR_ENV)
_KERNELS_ENV = {  # (launch.kernels_env: what the units carry while [kernels] is enabled, beside _OWNED_ENV's)
    "PDCTL_KERNELS_REQUIRED": "a refused plugin activation stops the server rather than serve on SGLang's kernels",
    "TRITON_CACHE_DIR": "the Triton binaries kernels_built compiled and verified, under engine.cache_dir",
}
# pdctl's SGLang plugin hooks these DSA decode paths of SGLang 0.5.23 (pdctl.kernels.sglang_plugin).
_PLUGIN_DECODE_BACKENDS = ("flashmla_kv", "flashmla_sparse")
_PLUGIN_VERSIONS = ("0.5.23",)
# ... and on DeepSeek-V4, 0.5.23's dsv4 backend with --dsv4-attn-backend flashmla (what "auto" resolves to for V4:
# arg_groups/deepseek_v4_hook.py _default_dsv4_attention_backend gives flashmla_mega to V4.1 on SM100 only), whose
# decode calls flash_mla_interface.flash_mla_with_kvcache on the 584-byte V4 rows, or on sm_120 GPUs (RTX PRO 6000
# Blackwell, GeForce RTX 50xx) flash_mla_sm120.flash_mla_with_kvcache_sm120 (deepseek_v4_backend.py
# _forward_attention: `if get_platform().is_sm120`), which the plugin hooks too; flashmla_mega and trtllm run other
# kernels (and trtllm another, uniform-FP8 layout), which the plugin does not hook.
_PLUGIN_DSV4_ATTN_BACKENDS = ("auto", "flashmla")
_OWNED_ROUTER_FLAGS = {
    "--host": "router.host",
    "--port": "router.port",
    "--pd-disaggregation": "the spec's shape",
    "--prefill": "[[prefill]] groups",
    "--decode": "[[decode]] groups",
    "--worker-urls": "the spec's roles",
    "--policy": "router.policy",
    "--prometheus-host": "router.prometheus_host",
    "--prometheus-port": "router.prometheus_port",
    "--worker-startup-timeout-secs": "router.worker_startup_timeout_s",
    "--health-check-interval-secs": "router.health_check_interval_s",
    "--health-check-timeout-secs": "router.health_check_timeout_s",
    "--health-failure-threshold": "router.health_failure_threshold",
    "--health-success-threshold": "router.health_success_threshold",
}
_PARSER_FLAGS = ("--reasoning-parser", "--tool-call-parser", "--chat-template")
_DP_REPLICA_FLAGS = ("--dp-size", "--data-parallel-size")
"""SGLang 0.5.23's ``--dp-size`` (``--data-parallel-size``): "The number of data-parallel replicas of the model"
(``launch_server --help``), each replica a whole TP group of its own GPUs behind the one HTTP port; pdctl renders
attn_dp as ``--attn-dp-size`` there. Up to 0.5.20 (``SglangFacts.legacy_dp_attention``) pdctl itself spells attention
DP ``--dp-size N --enable-dp-attention``."""
_PIPELINE_FLAGS = ("--pp-size", "--pipeline-parallel-size")
"""SGLang 0.5.23's pipeline-parallel size and its alias (``data/sglang-0.5.23-flags.json``): a server runs
tp × pp ranks, one per GPU (``--pp`` alone is an ambiguous prefix, refused as such)."""
# Settings SGLang's reference says must be the same on prefill and decode, which pdctl renders from no spec field:
# flag -> (the value when not given, why). Sources: shared/reference/sglang-pd.md §1.3 (prefill tokenizes the same
# chat independently and samples the first output token: one tokenizer on both), §1.1 and SGLang 0.5.23
# `launch_server --help` ("--disaggregation-enable-kv-checksum ... Enable on both prefill and decode engines";
# "--disaggregation-decode-allocation-policy ... Set the same policy on both roles. Default: early").
# (None: --tokenizer-path's default, the model path; True: a switch given.)
_SAME_ON_BOTH_SIDES: dict[str, tuple[str | bool | None, str]] = {
    "--tokenizer-path": (None, "prefill and decode each tokenize the same request, and decode continues from the "
                               "first token prefill sampled: they must use one tokenizer"),
    "--disaggregation-enable-kv-checksum": (False, "prefill computes the KV pages' checksum and decode verifies it: "
                                                   "SGLang says to enable it on both prefill and decode"),
    "--disaggregation-decode-allocation-policy": ("early", "it decides when decode reserves a request's KV and how "
                                                           "long prefill keeps it: SGLang says to set the same policy "
                                                           "on both roles"),
}
# --disaggregation-decode-allocation-policy prefill_complete: "Mooncake only, no attn-TP>1, no PP/CP"
# (shared/reference/sglang-pd.md §1.1, SGLang 0.5.23 arg_groups/fields/disagg.py). mooncake_tcp is Mooncake's
# transfer engine over TCP (§1.6), so it is counted as Mooncake here.
_MOONCAKE_BACKENDS = ("mooncake", "mooncake_tcp")
_ONE_HOST_FLAGS = ("--dist-init-addr", "--nnodes", "--node-rank")
"""SGLang 0.5.23's multi-node flags (``server_args.py``; ``--dist-init-addr`` also names the torch.distributed
rendezvous and moves the ports SGLang derives, ``PortArgs.init_new``): refused in a role's ``extra_args``."""
SMG_VERSION = "1.13.0"
"""The smg release pdctl pins (pyproject.toml's ``router`` extra) and whose flags it checks ``router.extra_args`` against."""


@functools.lru_cache(maxsize=None)
def _smg_record() -> dict:
    from importlib import resources

    return json.loads(resources.files("pdctl.statemachine").joinpath(f"data/smg-{SMG_VERSION}-flags.json").read_text())


def _smg_flags() -> frozenset[str]:
    """The option strings ``smg launch`` accepts (``data/smg-1.13.0-flags.json``, recorded from smg's own parser)."""
    return frozenset(_smg_record()["flags"])


def _smg_value_faults(args: list[str]) -> list[tuple[str, str]]:
    """``(message, fix)`` for each value in *args* (``router.extra_args``) that smg's parser refuses: a word outside a
    flag's choices, or not a whole number / number where the flag takes one (``data/smg-1.13.0-flags.json``'s
    ``values``, recorded from smg's own argparse parser). smg exits 2 on them ("invalid choice", "invalid int value")
    at router_exposed, after both servers' cold starts."""
    values = _smg_record().get("values", {})
    out = []
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if name not in values or name in _PARSER_FLAGS or name in _OWNED_ROUTER_FLAGS:  # (those refused as such)
            continue
        if eq:
            value = inline
        elif i + 1 < len(args) and not (args[i + 1].startswith("--") or args[i + 1] == "-"):
            value = args[i + 1]
        else:
            continue  # (no value: argparse says "expected one argument", as the stray-word check does not)
        rule = values[name]
        if "choices" in rule and value not in rule["choices"]:
            near = difflib.get_close_matches(value, rule["choices"], n=1, cutoff=0.6)
            out.append((f"{name} {value!r} is not one of smg {SMG_VERSION}'s choices "
                        f"({', '.join(rule['choices'])})", f"write {name} {near[0] if near else rule['choices'][0]}"
                        + ("" if near else " or another of those")))
        elif rule.get("type") in ("int", "float"):
            try:
                int(value) if rule["type"] == "int" else float(value)
            except ValueError:
                want = "a whole number" if rule["type"] == "int" else "a number"
                out.append((f"{name} {value!r} is not {want} (smg {SMG_VERSION} would exit 'invalid "
                            f"{rule['type']} value' at router_exposed)", f"give {name} {want}"))
    return out


def _stray_words(args: list[str], without_value: frozenset[str]) -> list[str]:
    """Words of *args* that no flag takes: before any flag, or after a flag that takes no value (argparse refuses
    them: "unrecognized arguments")."""
    stray, takes = [], False
    for a in args:
        if a.startswith("-"):
            takes = "=" not in a and a not in without_value
        elif not takes:
            stray.append(a)
    return stray


# The --policy choices of each router_impl, as its CLI lists them: smg 1.13.0 (the version pinned in pyproject.toml,
# `smg launch --help`) and sglang-router 0.3.2 (its launch_router CLI; shared/reference/sglang-pd.md, "Policies").
_ROUTER_POLICIES: dict[str, tuple[str, frozenset[str]]] = {
    "smg": ("smg 1.13.0", frozenset({"random", "round_robin", "passthrough", "cache_aware", "power_of_two",
                                     "least_load", "manual", "consistent_hashing", "prefix_hash"})),
    "sglang-router": ("sglang-router 0.3.2", frozenset({"random", "round_robin", "cache_aware", "power_of_two",
                                                        "manual"})),
}
# pdctl's kernels read 64-token pages: the FP8 656-byte latent KV rows through SGLang's page table and the
# indexer's paged FP8 index-K cache, 64 tokens x 132 B per page (shared/reference/kernels.md §1, kernels/_reference.py).
_KERNEL_PAGE_SIZE = 64
# SGLang's --mem-fraction-static is the fraction of GPU memory for weights and the KV pool; the rest holds
# activations, CUDA graphs and NCCL buffers. At or above this, warn that almost nothing is left for them.
_MEM_FRACTION_WARN = 0.95
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Environment variable names that carry credentials by convention (HF_TOKEN, OPENAI_API_KEY, AWS_SECRET_ACCESS_KEY,
# SECRET_KEY, DB_PASSWORD, GITHUB_PAT (a personal access token)…): one of these whole _-separated words anywhere,
# or a name ending in _KEY, so that TOKENIZERS_PARALLELISM or SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION are not taken
# for one; a name ending in _PATH, _FILE or _DIR holds where a secret is, not the secret; a switch value
# (HF_HUB_DISABLE_IMPLICIT_TOKEN=1) none.
_SECRET_NAME = re.compile(r"((^|_)(TOKEN|SECRET|PASSWORD|PASSWD|PASS|PAT|CREDENTIALS?|APIKEY)(_|$))|(^|_)KEY$",
                          re.IGNORECASE)
_SECRET_NAME_NOT = re.compile(r"_(PATH|FILE|DIR)$", re.IGNORECASE)
_SWITCH_VALUE = re.compile(r"0|1|true|false|yes|no|on|off", re.IGNORECASE)


def is_switch_value(value: str) -> bool:
    """Whether *value* is empty or a switch (``0``, ``true``, ``off``…), which no secret is."""
    return not value.strip() or bool(_SWITCH_VALUE.fullmatch(value.strip()))


def is_secret_env(name: str, value: str) -> bool:
    """Whether ``name=value`` of an env table looks like a credential (the names above, a value not a switch)."""
    return bool(_SECRET_NAME.search(name) and not _SECRET_NAME_NOT.search(name)) and not is_switch_value(value)


# DeepSeek checkpoints by name -> (family, SGLang tool-call parsers for its markup). Sources: SGLang
# docs/basic_usage/deepseek_v32.md (V3.2 -> deepseekv32; V3.2-Exp -> deepseekv31), 0.5.23
# sglang/srt/function_call/deepseekv4_detector.py (V4's DSML <｜DSML｜tool_calls>; deepseekv41 parses V4.1's other
# markup, <｜DSML｜ calls>, which a V4 checkpoint never emits), deepseekv31_detector.py (V3.1) and
# deepseekv3_detector.py (V3, R1). First match wins.
_DEEPSEEK_TOOL_PARSERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (r"v4[._-]?1", "DeepSeek-V4.1", ("deepseekv41",)),
    (r"v4", "DeepSeek-V4", ("deepseekv4",)),
    (r"v3[._-]?2[._-]?exp", "DeepSeek-V3.2-Exp", ("deepseekv31",)),
    (r"v3[._-]?2", "DeepSeek-V3.2", ("deepseekv32",)),
    (r"v3[._-]?1", "DeepSeek-V3.1", ("deepseekv31",)),
    (r"v3|r1", "DeepSeek-V3/R1", ("deepseekv3",)),
)


def _deepseek_family(model_path: str,
                     table: tuple[tuple[str, str, tuple[str, ...]], ...]) -> tuple[str, tuple[str, ...]] | None:
    """``(family, parsers)`` from *table* for a DeepSeek checkpoint named as DeepSeek publishes them
    (``deepseek-ai/DeepSeek-V4-Flash``), None for any other name (Speciale, which has no tool calling, and the R1
    distills, which take their base model's markup, included)."""
    name = model_path.rstrip("/").rsplit("/", 1)[-1].lower()
    if "deepseek" not in name or "speciale" in name or "distill" in name:
        return None
    for pattern, family, parsers in table:
        if re.search(pattern, name):
            return family, parsers
    return None


# DeepSeek checkpoints by name -> (family, SGLang reasoning parsers whose detector fits its thinking markup). Sources:
# SGLang docs/advanced_features/separate_reasoning.md (R1 series incl. R1-0528 -> deepseek-r1; V3.1/V3.2 ->
# deepseek-v3, the `thinking` request parameter) and 0.5.23 sglang/srt/parser/reasoning_parser.py (deepseek-v4 and
# deepseek-v41: DeepSeekV4Detector, the same <think> tokens with explicit thinking, like deepseek-v3). V3 (no
# thinking), Speciale and the R1 distills are not matched. First match wins.
_DEEPSEEK_REASONING_PARSERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (r"v4[._-]?1", "DeepSeek-V4.1", ("deepseek-v41", "deepseek-v4", "deepseek-v3")),
    (r"v4", "DeepSeek-V4", ("deepseek-v4", "deepseek-v41", "deepseek-v3")),
    (r"v3[._-]?[12]", "DeepSeek-V3.1/V3.2", ("deepseek-v3", "deepseek-v4", "deepseek-v41")),
    (r"r1", "DeepSeek-R1", ("deepseek-r1",)),
)


# DeepSeek checkpoints by name -> the attention path SGLang serves them on. Sources: SGLang 0.5.23
# sglang/srt/arg_groups/model_overrides/deepseek_v4.py (DeepseekV4ForCausalLM: attention_backend "dsv4" and
# page_size 256 on CUDA, declared over whatever --page-size says; models/deepseek_v4.py uses its own indexer, never
# the dsa backend's) and model_overrides/deepseek_v2.py (DeepseekV32ForCausalLM, V3.2 and V3.2-Exp: the dsa backend,
# 64-token pages). First match wins; other names are not judged.
_DEEPSEEK_ATTENTION: tuple[tuple[str, str], ...] = ((r"v4", "dsv4"), (r"v3[._-]?2", "dsa"))
_DSV4_PAGE_SIZE = 256
# What SGLang 0.5.23 lets a DeepSeek-V4 server start with (arg_groups/overrides.py, _deepseek_v4_kv_cache_dtype: auto
# becomes fp8_e4m3, then it asserts fp8_e4m3 or bfloat16; "bf16" is not normalised for V4 as it is for DSA)
_DSV4_KV_DTYPES = ("auto", "fp8_e4m3", "bfloat16")


def _deepseek_attention(model_path: str) -> str | None:
    """``"dsv4"`` (DeepSeek-V4, V4.1), ``"dsa"`` (V3.2, V3.2-Exp, V3.2-Speciale) or None for *model_path* named as
    DeepSeek publishes its checkpoints (``deepseek-ai/DeepSeek-V4-Flash``); None for any other name."""
    name = model_path.rstrip("/").rsplit("/", 1)[-1].lower()
    if "deepseek" not in name or "distill" in name:
        return None
    return next((path for pattern, path in _DEEPSEEK_ATTENTION if re.search(pattern, name)), None)


_FAILS_LATE = "(parsers_configured then fails, after both servers restarted)"
# (field, table, SGLang facts' list, the parser in words, what it parses, its verb, unset: what is left, misfit: what
# a parser for other markup does)
_DEEPSEEK_PARSER_FIT = (
    ("tool_call_parser", _DEEPSEEK_TOOL_PARSERS, "tool_call_parsers", "tool-call parser", "tool calls", "parses with",
     "its tool calls stay raw markup in the content", "would leave its tool-call markup in the content"),
    ("reasoning_parser", _DEEPSEEK_REASONING_PARSERS, "reasoning_parsers", "reasoning parser", "thinking",
     "separates with", "its thinking stays in the content, with no reasoning_content",
     "would leave its reasoning in the content or take its answer for reasoning"),
)


@dataclass(frozen=True)
class Finding:
    """One rule's verdict. ``field`` is the spec path, ``fix`` what to change."""

    level: Literal["error", "warning"]
    field: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.level}: {self.field}: {self.message} — fix: {self.fix}"

    def to_json(self) -> dict[str, str]:
        """``{field, message, fix}``, as every ``--json`` output lists a finding."""
        return {"field": self.field, "message": self.message, "fix": self.fix}


@dataclass(frozen=True)
class Inventory:
    """A host's GPU and NUMA facts. ``gpu_numa[i]`` is GPU i's NUMA node (-1: none reported)."""

    gpu_numa: tuple[int, ...] | None = None
    numa_cpus: dict[int, str] | None = None


def _role_field(dep: Deployment, role: ServerRole) -> str:
    for kind in ("prefill", "decode", "server"):
        group = getattr(dep, kind)
        for i, r in enumerate(group):
            if r is role:
                return f"{kind}[{i}]"
    return "?"


_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
"""A word argparse takes as a value although it starts with '-' (``argparse._negative_number_matcher``; SGLang's
parser has no option that looks like a negative number)."""


def _is_option(word: str, known: frozenset[str]) -> bool:
    """Whether argparse reads *word* as an option string rather than a value (``ArgumentParser._parse_optional``,
    CPython 3.12): a known option (or one with ``=value``) always; else a word starting with '-' unless it is '-'
    alone, a negative number or holds a space."""
    if not word.startswith("-") or word == "-":
        return False
    if word in known or word.split("=", 1)[0] in known:
        return True
    return not _NEGATIVE_NUMBER.match(word) and " " not in word


def _launch_arg_faults(args: list[str], facts, skip: set[str]) -> list[tuple[str, str]]:  # noqa: ANN001
    """What argparse would refuse in *args* given to SGLang's ``launch_server`` (*facts*: its recorded arguments,
    :attr:`~pdctl.statemachine.sglang_facts.SglangFacts.arguments`), as ``(message, fix)``: a word no flag takes, a
    flag without the value it needs or with one it takes none of, a value outside the flag's choices or not of its
    type (int, float, JSON for ``json.loads``; other parser functions are not judged), a single-dash option SGLang
    does not have. ``--`` flags in *skip*, and ``--`` flags not recorded, are judged elsewhere: their values are only
    passed over. SGLang would exit 2 at the role's start, after the units were installed."""
    v = facts.version
    known = facts.flags or frozenset()
    faults: list[tuple[str, str]] = []
    starved = False  # (the previous flag lacked its value: a '-…' word right after it was meant as that value)
    for word, name, full, arg, eq, values in _argv_items(args, facts):
        after_starved, starved = starved, False
        if name is None:
            flag, space, value = word.strip().partition(" ")
            faults.append((f"{word!r}: no flag takes it (SGLang {v} would exit 'unrecognized arguments')",
                           # (one string "--flag value": the argv gets it as one word; each is its own list item)
                           f'give the flag and its value as two items: ["{flag}", "{value.strip()}"]'
                           if space and flag.startswith("--") and _is_option(flag, known) else
                           'give each value after its flag, e.g. ["--max-running-requests", "64"]'))
            continue
        fewest, most = arg.takes if arg is not None else (0, None)
        if name == "-h":
            faults.append(("-h makes SGLang print its help and exit: the server would not start", "remove -h"))
            continue
        if not name.startswith("--"):
            if after_starved:  # (said with that flag: its value joined with '=')
                continue
            faults.append((f"{word!r}: argparse reads a word starting with '-' as an option, and SGLang {v} has no "
                           f"option {name}", "write the flag in full (--…), or give a value that starts with '-' "
                           "joined to its flag: --flag=-value"))
            continue
        if arg is None or name in skip or full in skip:
            continue
        if eq and most == 0:
            faults.append((f"{word!r}: {name} takes no value (SGLang {v} would exit 'ignored explicit argument')",
                           f"write {name} alone"))
            continue
        if len(values) < fewest:
            starved = True
            faults.append((f"{name} needs {'a value' if most == 1 else 'one or more values'} after it (SGLang {v} would "
                           f"exit 'expected {'one argument' if most == 1 else 'at least one argument'}')",
                           f'give it its value: ["{name}", "…"] (a value starting with \'-\': "{name}=-…")'))
        for value in values:
            try:  # (argparse converts first, then compares with the choices)
                typed = str(int(value)) if arg.type == "int" else value
                if arg.type == "float":
                    float(value)
                elif arg.type == "loads":
                    json.loads(value)
            except ValueError:
                what = {"int": "a whole number", "float": "a number", "loads": "JSON"}[arg.type]
                faults.append((f"{name} {value!r}: not {what} (SGLang {v} would exit 'invalid {arg.type} value')",
                               f"give {name} {what}"))
                continue
            if arg.choices is not None and typed not in arg.choices:
                faults.append((f"{name} {value!r} is not one of SGLang {v}'s choices: {', '.join(arg.choices)}",
                               f"give {name} one of them"))
            elif name in _LOADED_AS_JSON_OBJECT and not isinstance(_json_or_none(value), dict):
                faults.append((f"{name} {value!r}: not a JSON object (SGLang {v} takes the string and json.loads it "
                               "while preparing the server's arguments: the server would exit at its start)",
                               f"give {name} a JSON object, e.g. '{{\"max_position_embeddings\": 163840}}'"))
    return faults


_LOADED_AS_JSON_OBJECT = frozenset({"--json-model-override-args"})
"""Flags argparse takes as a plain string that SGLang then reads with ``json.loads`` as a dictionary
(``--json-model-override-args``: "A dictionary in JSON string format", ``ModelConfig.from_server_args``)."""


def _json_or_none(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _argv_items(args: list[str], facts):  # noqa: ANN001, ANN202
    """*args* (a server's ``extra_args``) as SGLang's argparse splits them: per word it reads as an option,
    ``(word, name, full, arg, inline, values)``: *name* the option string as written (without ``=value``), *full* that
    of the flag it names (an unambiguous ``--`` abbreviation resolved, as argparse does), *arg* its recorded argument
    (:meth:`~pdctl.statemachine.sglang_facts.SglangFacts.argument`; None where *facts* is None or does not record it),
    *inline* whether its value came joined by '=', *values* the words it takes (a flag not recorded: each up to the
    next option); per word no flag takes, ``(word, None, None, None, False, [])``."""
    known = facts.flags if facts is not None and facts.flags is not None else frozenset()
    i = 0
    while i < len(args):
        word = args[i]
        i += 1
        if not _is_option(word, known):
            yield word, None, None, None, False, []
            continue
        name, eq, inline = word.partition("=")
        full = name
        if known and name.startswith("--") and name not in known:
            prefix_of = [x for x in known if x.startswith(name)]
            full = prefix_of[0] if len(prefix_of) == 1 else name
        arg = facts.argument(full) if facts is not None else None
        most = arg.takes[1] if arg is not None else None
        values = [inline] if eq else []
        while not eq and i < len(args) and not _is_option(args[i], known) and (most is None or len(values) < most):
            values.append(args[i])
            i += 1
        yield word, name, full, arg, bool(eq), values


def _given(args: list[str], facts) -> dict[str, str | bool]:  # noqa: ANN001
    """What *args* (a role's ``extra_args``) set, as SGLang's argparse reads them (:func:`_argv_items`): ``{flag:
    value}`` keyed by the argument's first option string (``--pipeline-parallel-size`` → ``--pp-size``; an
    unambiguous abbreviation as its flag), the last occurrence winning as argparse's store does; True for a flag given
    without a value. *facts* (:class:`~pdctl.statemachine.sglang_facts.SglangFacts` or None) says what each flag
    takes."""
    out: dict[str, str | bool] = {}
    for _word, name, full, arg, eq, values in _argv_items(args, facts):
        if name is None or not name.startswith("--"):
            continue
        canon = arg.flags[0] if arg is not None else ("--pp-size" if full in _PIPELINE_FLAGS else full)
        out[canon] = values[0] if eq else (" ".join(values) if values else True)
    return out


def _pipeline_size(given: dict[str, str | bool]) -> int:
    """The ``--pp-size`` *given* sets (1 unset; a value that is no positive whole number is judged elsewhere)."""
    try:
        pp = int(given.get("--pp-size", 1))  # type: ignore[arg-type]
    except ValueError:
        return 1
    return pp if pp >= 1 else 1


def _flag_name(arg: str) -> str | None:
    if not arg.startswith("--"):
        return None
    return arg.split("=", 1)[0]


def _gpu_range(gpus: list[int]) -> str:
    return ",".join(str(g) for g in gpus)


def validate(dep: Deployment, *, inventories: dict[str, Inventory] | None = None) -> list[Finding]:
    """Every finding for *dep*, errors first. Pure: contacts nothing, changes nothing.

    *inventories* maps host keys to discovered facts; hosts missing from it fall back to what the
    spec declares (``gpu_numa``/``numa_cpus``), and rules needing an unknown inventory are skipped.
    """
    out: list[Finding] = []

    def err(field: str, message: str, fix: str) -> None:
        out.append(Finding("error", field, message, fix))

    def warn(field: str, message: str, fix: str) -> None:
        out.append(Finding("warning", field, message, fix))

    roles = dep.roles()

    # --- target version -----------------------------------------------------------------------
    try:
        facts = facts_for(dep.sglang_version)
    except KeyError:
        err(
            "sglang_version",
            f"pdctl has no facts for SGLang {dep.sglang_version}",
            f"use one of {', '.join(KNOWN_VERSIONS)}",
        )
        facts = None

    # --- hosts and inventory --------------------------------------------------------------------
    inv: dict[str, Inventory] = {}
    for key, host in dep.hosts.items():
        if inventories and key in inventories:
            inv[key] = inventories[key]
        elif host.gpu_numa is not None or host.numa_cpus is not None:
            inv[key] = Inventory(
                tuple(host.gpu_numa) if host.gpu_numa is not None else None, host.numa_cpus
            )

    # (undeclared hosts are reported once, below; counting them here would add a contradictory second error)
    used_hosts = sorted(h for h in {r.host for _n, _k, r in roles} | ({dep.router.on} if dep.router and dep.router.on
                                                                        else set()) if h in dep.hosts)
    if len(used_hosts) > 1:
        err(
            "hosts",
            f"roles run on {len(used_hosts)} hosts ({', '.join(used_hosts)}): pdctl drives one host per deployment",
            "put prefill, decode and the router on one [hosts.*] entry",
        )
    for key, host in sorted(dep.hosts.items()):
        ignored = [a for a in ("ssh_user", "ssh_identity", "ssh_known_hosts") if getattr(host, a) is not None]
        ignored += ["ssh_port"] if host.ssh_port != 22 else []
        if host.is_local and ignored:  # (a host meant to be reached over SSH, driven here by mistake)
            why = ('connect = "local"' if host.connect == "local"
                   else f"address {host.address!r} is this machine's loopback (connect = \"auto\")")
            warn(f"hosts.{key}.{ignored[0]}",
                 f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} ignored: {why}, so pdctl drives this "
                 "machine directly, without SSH",
                 f'for the machine at that address, write its reachable address or connect = "ssh"; for this machine, '
                 f"remove {', '.join(ignored)}")
        for attr in ("ssh_identity", "ssh_known_hosts"):
            path = getattr(host, attr)
            if path and not host.is_local and not os.path.isfile(path):
                err(f"hosts.{key}.{attr}", f"{path} is not a file on this machine",
                    "give the path of an existing file (relative paths are relative to the spec's folder)")

    # An undeclared host is reported once, at the first field that names it; the router's default host (the first
    # role's) is not reported again as router.on, which the spec may not even set.
    undeclared: dict[str, list[str]] = {}
    for _name, _kind, role in roles:
        if role.host not in dep.hosts:
            undeclared.setdefault(role.host, []).append(f"{_role_field(dep, role)}.host")
    if dep.router is not None and dep.router.on is not None and dep.router.on not in dep.hosts:
        undeclared.setdefault(dep.router.on, []).append("router.on")
    for key, fields in undeclared.items():
        also = f" (also named by {', '.join(fields[1:])})" if fields[1:] else ""
        err(fields[0], f"host {key!r} is not declared{also}", f"add [hosts.{key}] or use one of {sorted(dep.hosts)}")

    for name, _kind, role in roles:
        f = _role_field(dep, role)
        if role.host not in dep.hosts:
            continue
        # GPU count vs parallel sizes (SGLang: attention-DP groups live inside the TP group; pipeline stages, given
        # in extra_args as --pp-size, each take a TP group of their own: tp × pp ranks, one per GPU)
        pp = _pipeline_size(_given(list(role.extra_args), facts))
        if len(role.gpus) != role.tp * pp:
            err(
                f"{f}.gpus",
                f"{len(role.gpus)} GPUs ({_gpu_range(role.gpus)}) but tp = {role.tp}: SGLang runs one rank per GPU"
                if pp == 1 else
                f"{len(role.gpus)} GPUs ({_gpu_range(role.gpus)}) but tp = {role.tp} × pp {pp} = {role.tp * pp} "
                "ranks (pp: --pp-size in extra_args): SGLang runs tp × pp ranks, one rank per GPU",
                f"list exactly {role.tp} GPUs, or set tp = {len(role.gpus)}" if pp == 1 else
                f"list exactly {role.tp * pp} GPUs, or set tp and --pp-size so that tp × pp = {len(role.gpus)}",
            )
        if role.tp % role.attn_dp:
            err(f"{f}.attn_dp", f"attn_dp = {role.attn_dp} does not divide tp = {role.tp}", "choose an attn_dp that divides tp")
        if role.tp % role.ep:
            err(f"{f}.ep", f"ep = {role.ep} does not divide tp = {role.tp}", "choose an ep that divides tp")
        hinv = inv.get(role.host)
        if hinv and hinv.gpu_numa is not None:
            missing = [g for g in role.gpus if g >= len(hinv.gpu_numa)]
            if missing and not hinv.gpu_numa and not (inventories and role.host in inventories):
                err(
                    f"{f}.gpus",
                    f"host {role.host!r} declares no GPUs (gpu_numa = [])",
                    f"list each GPU's NUMA node in hosts.{role.host}.gpu_numa (nvidia-smi topo -m), or leave it out",
                )
            elif missing and not hinv.gpu_numa:
                err(f"{f}.gpus", f"host {role.host!r} has no GPUs (nvidia-smi lists none)",
                    "run the role on a host with GPUs")
            elif missing:
                has = "GPU 0" if len(hinv.gpu_numa) == 1 else f"GPUs 0-{len(hinv.gpu_numa) - 1}"
                err(
                    f"{f}.gpus",
                    f"GPU {missing} not on host {role.host!r}, which has {has}",
                    "use GPU ids the host has (nvidia-smi -L)",
                )
            nodes = sorted({hinv.gpu_numa[g] for g in role.gpus if g < len(hinv.gpu_numa) and hinv.gpu_numa[g] >= 0})
            exists = hinv.numa_cpus is None or role.numa_node in hinv.numa_cpus  # (else: its own error, below)
            if role.numa_node is not None and len(nodes) == 1 and nodes != [role.numa_node] and exists:
                # every GPU of the role on one other node: its unit would bind memory and threads to the far socket
                err(
                    f"{f}.numa_node",
                    f"numa_node = {role.numa_node} but GPUs {_gpu_range(role.gpus)} all sit on NUMA node {nodes[0]}: "
                    "the role's memory and CPU threads would be bound to the other socket from its GPUs",
                    f"set numa_node = {nodes[0]} (or leave it out: the GPUs' node is used)",
                )
            elif role.numa_node is not None and len(nodes) > 1:
                warn(
                    f"{f}.numa_node",
                    f"numa_node = {role.numa_node} but GPUs {_gpu_range(role.gpus)} sit on NUMA nodes {nodes}",
                    "pick GPUs from one NUMA node",
                )
            elif len(nodes) > 1 and len(role.gpus) <= max(hinv.gpu_numa.count(n) for n in nodes):
                # (a group that one node's GPUs could hold, unlike TP8 over a two-socket host's eight: no binding is
                # rendered for it, NUMAMask= nor CPUAffinity=, while the other roles get theirs: a typo in gpu_numa
                # dropped the binding in silence)
                warn(
                    f"{f}.gpus",
                    f"GPUs {_gpu_range(role.gpus)} sit on NUMA nodes {nodes} (hosts.{role.host}.gpu_numa): the role's "
                    "unit gets no NUMA binding, its memory and threads go anywhere, and its TP group crosses sockets",
                    f"pick GPUs from one NUMA node, or set {f}.numa_node to bind it to one (or check gpu_numa: "
                    "nvidia-smi topo -m)",
                )
        if hinv and hinv.numa_cpus:
            node = role_node(role.numa_node, role.gpus, hinv.gpu_numa)
            if node is not None and hinv.numa_cpus.get(node) == "":
                warn(
                    f"{f}.numa_node",
                    f"NUMA node {node} is declared without CPUs (numa_cpus {node} = \"\"): the role's memory is "
                    "bound to it, its threads to no CPUs in particular",
                    f"declare node {node}'s CPUs (/sys/devices/system/node/node{node}/cpulist), or bind the role to "
                    "a node with CPUs",
                )
        if hinv and hinv.numa_cpus is not None and role.numa_node is not None and role.numa_node not in hinv.numa_cpus:
            if not hinv.numa_cpus:
                err(
                    f"{f}.numa_node",
                    f"NUMA node {role.numa_node}, but host {role.host!r} declares no NUMA nodes (numa_cpus = {{}})",
                    f'declare each node\'s CPUs in hosts.{role.host}.numa_cpus, e.g. {{ 0 = "0-31", 1 = "32-63" }} '
                    "(/sys/devices/system/node/node*/cpulist), or leave it out",
                )
            else:
                err(
                    f"{f}.numa_node",
                    f"NUMA node {role.numa_node} does not exist on host {role.host!r} (nodes {sorted(hinv.numa_cpus)})",
                    "use a node the host has (ls /sys/devices/system/node)",
                )

    # --- declared CPU lists: a CPU belongs to one NUMA node; every GPU's node is declared ------------
    for key, host in dep.hosts.items():
        if host.gpu_numa and host.numa_cpus and not (inventories and key in inventories):
            undeclared = sorted({n for n in host.gpu_numa if n >= 0} - set(host.numa_cpus))
            if undeclared:
                err(
                    f"hosts.{key}.gpu_numa",
                    f"names NUMA node(s) {undeclared}, which numa_cpus does not declare (nodes "
                    f"{sorted(host.numa_cpus)})",
                    f"declare their CPUs in hosts.{key}.numa_cpus, or correct gpu_numa (nvidia-smi topo -m)",
                )
        nodes = [(n, cpu_set(cpus)) for n, cpus in sorted((host.numa_cpus or {}).items())]
        for i, (a, cpus_a) in enumerate(nodes):
            for b, cpus_b in nodes[i + 1:]:
                both = cpus_a & cpus_b
                if both:
                    err(
                        f"hosts.{key}.numa_cpus",
                        f"CPUs {cpu_list(','.join(map(str, sorted(both))))} are listed under NUMA nodes {a} and {b}",
                        "a CPU belongs to one node: copy each node's list from "
                        "/sys/devices/system/node/node<N>/cpulist on the host",
                    )

    # --- GPU overlap per host -------------------------------------------------------------------
    by_host_gpu: dict[tuple[str, int], str] = {}
    for name, _kind, role in roles:
        f = _role_field(dep, role)
        for g in role.gpus:
            other = by_host_gpu.get((role.host, g))
            if other is not None:
                err(
                    f"{f}.gpus",
                    f"GPU {g} on host {role.host!r} is already used by {other}",
                    "give each role its own GPUs",
                )
            else:
                by_host_gpu[(role.host, g)] = f"{_role_field(dep, role)} ({name})"

    # --- ports per host -------------------------------------------------------------------------
    ports: dict[tuple[str, int], str] = {}

    def claim(host: str, port: int, owner: str, field: str) -> None:
        other = ports.get((host, port))
        if other is not None:
            derived = "derived ZMQ port" in other or "derived ZMQ port" in owner  # (said only where it is the cause)
            err(field, f"port {port} on host {host!r} is also {other}",
                f"choose a port nothing else on host {host!r} uses" + (
                    f" (a server with attention-DP also takes SGLang's derived ports, its port "
                    f"+{min(DERIVED_PORT_OFFSETS)} to +{max(DERIVED_PORT_OFFSETS)})" if derived else ""))
        else:
            ports[(host, port)] = owner

    prefill_bootstrap: dict[tuple[str, int], str] = {}
    for name, kind, role in roles:
        f = _role_field(dep, role)
        claim(role.host, role.port, f"{f}.port (HTTP of {name})", f"{f}.port")
        if kind == "prefill":
            bp = role.bootstrap_port or 8998
            key = (role.host, bp)
            if key in prefill_bootstrap:
                err(
                    f"{f}.bootstrap_port",
                    f"bootstrap port {bp} is shared with {prefill_bootstrap[key]} on host {role.host!r}",
                    "give every prefill server on one host its own bootstrap_port",
                )
            else:
                prefill_bootstrap[key] = f"{f} ({name})"
                claim(role.host, bp, f"{f}.bootstrap_port (bootstrap of {name})", f"{f}.bootstrap_port")
        elif role.bootstrap_port is not None and kind == "server":
            err(f"{f}.bootstrap_port", "a single server has no bootstrap server", "remove bootstrap_port")
        if role.nccl_port is not None:
            claim(role.host, role.nccl_port, f"{f}.nccl_port (NCCL of {name})", f"{f}.nccl_port")
        if role.attn_dp > 1:
            for off in DERIVED_PORT_OFFSETS:
                claim(
                    role.host,
                    role.port + off,
                    f"SGLang's derived ZMQ port {role.port}+{off} of {name} (attention-DP)",
                    f"{f}.port",
                )

    router = dep.router
    router_host = None
    if router is not None:
        router_host = router.on or (roles[0][2].host if roles else "local")  # (undeclared: reported above)
        impl, policies = _ROUTER_POLICIES[dep.router_impl]
        if router.policy not in policies:
            err(
                "router.policy",
                f"{router.policy!r} is not a --policy of {impl} (router_impl = {dep.router_impl!r}): the router "
                "would refuse to start",
                _closest("policy", router.policy, policies, where=impl),
            )
        server_ports = {(r.host, r.port): n for n, _k, r in roles}
        if (router_host, router.port) in server_ports:
            err(
                "router.port",
                f"router port {router.port} equals the HTTP port of {server_ports[(router_host, router.port)]}",
                "give the router its own port (the exposed one, e.g. 30001) and move the server",
            )
        else:
            claim(router_host, router.port, "router.port", "router.port")
        claim(router_host, router.prometheus_port, "router.prometheus_port", "router.prometheus_port")
        if is_wildcard(router.prometheus_host) and not router.allow_public_prometheus:
            warn(
                "router.prometheus_host",
                f"router metrics are exposed on {url_host(router.prometheus_host)}:{router.prometheus_port}",
                "bind them to 127.0.0.1, or set router.allow_public_prometheus = true to mean it",
            )
        if dep.router_impl == "smg":
            # smg 1.13 parses its bind addresses as IP literals and refuses to start otherwise ("invalid bind host
            # 'localhost': expected an IP address such as 0.0.0.0, ::, [::] or [fd00::1]"), after apply stopped the
            # router it replaces
            for fld in ("host", "prometheus_host"):
                value = getattr(router, fld)
                try:
                    ipaddress.ip_address(value.strip("[]"))
                except ValueError:
                    err(f"router.{fld}", f"{value!r} is a host name, and smg binds only an IP address (it refuses to "
                                         "start with a name)",
                        f'write {fld} = "127.0.0.1"' if value == "localhost" else
                        f"write the address the name stands for (`getent hosts {value}` on the host), or "
                        f'{fld} = "0.0.0.0" for every interface')
        for fld in ("reasoning_parser", "tool_call_parser", "chat_template"):
            if getattr(router, fld) is not None:
                err(
                    f"router.{fld}",
                    "parsers and chat templates belong on the SGLang servers, never on the router "
                    "(in HTTP mode the router forwards requests; the decode server's parser shapes the answer)",
                    f"move it to [parsers].{fld} and remove it from [router]",
                )
        stray = _stray_words(list(router.extra_args), frozenset(_smg_record()["flags_without_value"])) \
            if dep.router_impl == "smg" else []
        if stray:
            err("router.extra_args", f"{', '.join(map(repr, stray))}: no flag takes {'it' if len(stray) == 1 else 'them'} "
                f"(smg {SMG_VERSION} would exit 'unrecognized arguments' at router_exposed)",
                'give each value after its flag, e.g. ["--policy", "random"] (or set router.policy)')
        if dep.router_impl == "smg":
            for message, fix in _smg_value_faults(list(router.extra_args)):
                err("router.extra_args", message, fix)
        for arg in router.extra_args:
            name = _flag_name(arg)
            if name in _PARSER_FLAGS:
                err(
                    "router.extra_args",
                    f"{name} on the router: parsers belong on the prefill and decode servers",
                    f"remove {name} from router.extra_args and set [parsers] instead",
                )
            elif name in _OWNED_ROUTER_FLAGS:
                err(
                    "router.extra_args",
                    f"{name} is set by pdctl from {_OWNED_ROUTER_FLAGS[name]}",
                    f"remove {name} from router.extra_args and set {_OWNED_ROUTER_FLAGS[name]}",
                )
            elif name is not None and dep.router_impl == "smg" and name not in _smg_flags():
                # smg exits 2 ("unrecognized arguments") at router_exposed, after both servers' cold starts
                import difflib

                near = difflib.get_close_matches(name, sorted(_smg_flags()), n=3, cutoff=0.6)
                err("router.extra_args", f"{name} is not a flag of smg {SMG_VERSION} (`smg launch`)",
                    (f"did you mean {' or '.join(map(repr, near))}? " if near else "")
                    + f"`smg launch --help` lists smg {SMG_VERSION}'s flags")
            elif name == "--api-key":
                err(
                    "router.extra_args",
                    "--api-key makes the router answer 401 to the requests pdctl proves it with (/workers, /readiness, "
                    "the chat check), which carry no key: router_exposed would fail after the router restarted; and "
                    "extra_args are written into the unit in plain text",
                    "remove --api-key; put the authentication in front of the router (a reverse proxy), which pdctl "
                    "does not manage",
                )
        cold = [(n, r.expected_cold_start_s) for n, _k, r in roles if r.expected_cold_start_s]
        for n, cs in cold:
            if router.worker_startup_timeout_s <= cs:  # a worker up only just in time is a race: longer, strictly
                err(
                    "router.worker_startup_timeout_s",
                    f"{router.worker_startup_timeout_s} s is not longer than {n}'s expected cold start "
                    f"({int(cs) if float(cs).is_integer() else cs} s): smg abandons a worker that is not up in time "
                    "and never retries it",
                    f"set router.worker_startup_timeout_s >= {math.floor(cs) + 1}",
                )
    elif dep.is_pd:
        err("router", "a PD deployment needs a router in front of prefill and decode", "add a [router] table")

    # --- PD link --------------------------------------------------------------------------------
    if dep.is_pd:
        kv = dep.kv_transfer
        if kv is None:
            err("kv_transfer", "a PD deployment needs a KV transfer backend", 'add [kv_transfer] backend = "nixl"')
        else:
            if kv.backend == "fake":
                err(
                    "kv_transfer.backend",
                    "SGLang refuses it: \"Prefill server does not support 'fake' as the transfer backend\" "
                    "(fake moves no KV; decode-only synthetic benchmarks)",
                    'use "nixl", "mooncake" or "mooncake_tcp"',
                )
            elif facts is not None and kv.backend not in facts.transfer_backends:
                err(
                    "kv_transfer.backend",
                    f"{kv.backend!r} is not a transfer backend of SGLang {facts.version}",
                    f"use one of {sorted(facts.transfer_backends)}",
                )
            # --disaggregation-ib-device: "mlx5_0 | mlx5_0,mlx5_1 | per-GPU JSON '{"0":"mlx5_0,mlx5_1","1":"mlx5_2"}'
            # | path to JSON file" (shared/reference/sglang-pd.md §1.1): a comma-separated list of HCA names, where a
            # space would be read as part of a device name
            if kv.ib_device is not None:
                lists: list[tuple[str, str]] = []  # (where in the value, the device list)
                text = kv.ib_device.strip()
                if text.startswith("{"):
                    per_gpu = _json_or_none(text)
                    if isinstance(per_gpu, dict):
                        lists = [(f"GPU {k}'s list", v) for k, v in per_gpu.items() if isinstance(v, str)]
                elif "/" not in text and not text.endswith(".json"):  # (else a path to the JSON file)
                    lists = [("", kv.ib_device)]
                for where, devices in lists:
                    if re.search(r"\s", devices):
                        fixed = ",".join(x for x in re.split(r"[\s,]+", devices) if x)
                        err(
                            "kv_transfer.ib_device",
                            f"{(where + ' ') if where else ''}{devices!r} holds whitespace: SGLang takes a "
                            "comma-separated list of HCA names (--disaggregation-ib-device) and would look for a "
                            "device named with the space",
                            f'write "{fixed}"' + (f" for GPU {where.split()[1][:-2]}" if where else ""),
                        )
            # UCX_NET_DEVICES is read by UCX, which only NIXL uses (SGLANG_DISAGGREGATION_NIXL_BACKEND, default UCX;
            # shared/reference/sglang-pd.md §1.5: "UCX device/transport selection for NIXL")
            if kv.ucx_net_devices is not None and kv.backend != "nixl":
                warn(
                    "kv_transfer.ucx_net_devices",
                    f"UCX_NET_DEVICES only applies to NIXL over UCX; with backend = {kv.backend!r} nothing reads it, "
                    "and the KV link uses the backend's own device choice",
                    "remove kv_transfer.ucx_net_devices" + (" and name the HCAs in kv_transfer.ib_device"
                                                            if kv.backend.startswith("mooncake") else "")
                    + ', or set backend = "nixl"',
                )
        decode_hosts = {r.host for r in dep.decode if r.host in dep.hosts}  # (an undeclared one is reported above)
        for i, p in enumerate(dep.prefill):
            if p.host not in dep.hosts:  # (reported above; where it runs is not known, so neither is what it reaches)
                continue
            remote = sorted(h for h in decode_hosts if h != p.host)
            if remote and p.http_host in _LOOPBACK:
                err(
                    f"prefill[{i}].http_host",
                    f"prefill binds {p.http_host}, which also binds its bootstrap server, but decode runs on "
                    f"{remote}: decode cannot reach the bootstrap",
                    "set http_host to an address the decode host can reach (or 0.0.0.0)",
                )
        # page size / kv dtype must match: decode raises "Page size mismatch" / "KV cache dtype mismatch".
        def eff(role: ServerRole, attr: str):
            v = getattr(role, attr)
            return v if v is not None else getattr(dep.model, attr)

        for attr in ("page_size", "kv_cache_dtype"):
            values = {(_role_field(dep, r), eff(r, attr)) for r in dep.prefill + dep.decode}
            distinct = {v for _f, v in values}
            if len(distinct) > 1:
                where = ", ".join(f"{f}={v}" for f, v in sorted(values, key=str))
                err(
                    f"decode[0].{attr}" if any(getattr(r, attr) is not None for r in dep.decode) else f"prefill[0].{attr}",
                    f"{attr} differs between prefill and decode ({where}); SGLang decode refuses the "
                    f"transfer ('{attr.replace('_', ' ').capitalize()} mismatch')",
                    f"set one model.{attr} and remove the per-role overrides",
                )
        # settings the reference says must match on prefill and decode, given in extra_args (_SAME_ON_BOTH_SIDES)
        pd_roles = [(_role_field(dep, r), r, _given(list(r.extra_args), facts)) for r in dep.prefill + dep.decode]
        for flag, (default, why) in _SAME_ON_BOTH_SIDES.items():
            if not any(flag in g for _f, _r, g in pd_roles):
                continue
            if flag == "--tokenizer-path":  # (unset: the model path's tokenizer)
                default = dep.model.path
            seen = [(f, g.get(flag, default), flag in g) for f, _r, g in pd_roles]
            if len({str(v) for _f, v, _x in seen}) > 1:
                unset = ("off" if default is False else f"the model path, {default!r}" if flag == "--tokenizer-path"
                         else f"{default!r}, the default")
                said = "; ".join(f"{f}.extra_args " + (("gives it" if v is True else f"gives {v!r}") if given else
                                                      f"leaves it unset ({unset})")
                                 for f, v, given in seen)
                first = next(f for f, _v, given in seen if given)
                err(
                    f"{first}.extra_args",
                    f"{flag} differs between prefill and decode ({said}): {why}",
                    f"give every [[prefill]] and [[decode]] group the same {flag} in its extra_args, or remove it "
                    "from all of them",
                )
        policy = "--disaggregation-decode-allocation-policy"
        for f, r, g in pd_roles:
            if g.get(policy) != "prefill_complete":
                continue
            faults, fixes = [], []
            if kv is not None and kv.backend not in _MOONCAKE_BACKENDS:
                faults.append(f"kv_transfer.backend = {kv.backend!r}")
                fixes.append('set kv_transfer.backend = "mooncake"')
            if r.tp // max(r.attn_dp, 1) > 1:
                faults.append(f"attention TP {r.tp // max(r.attn_dp, 1)} (tp = {r.tp}, attn_dp = {r.attn_dp})")
                fixes.append(f"set attn_dp = tp on {f}")
            for flag, what in (("--pp-size", "pipeline"), ("--attn-cp-size", "context")):
                size = g.get(flag, "1")
                if isinstance(size, str) and size.isdigit() and int(size) > 1:
                    faults.append(f"{flag} {size}")
                    fixes.append(f"drop {flag} ({what} parallelism)")
            if faults:
                err(
                    f"{f}.extra_args",
                    f"{policy} prefill_complete works only with Mooncake, attention TP 1 and no pipeline or "
                    f"context parallelism (SGLang 0.5.23), and this role has {', '.join(faults)}",
                    f"remove {policy} (early, the default) from every group's extra_args, or {' and '.join(fixes)}",
                )
                break
        if kv is not None and kv.backend in ("nixl", "mooncake", "mori") and dep.service_manager == "systemd-user":
            # the units ask LimitMEMLOCK=infinity for RDMA registration; a user's manager cannot raise its own hard
            # limit (setrlimit(2): only a privileged process can), so it starts the servers with the user's
            warn("service_manager",
                 f"{kv.backend} registers the KV cache for RDMA, for which the units ask LimitMEMLOCK=infinity; a "
                 "systemd user manager cannot raise the locked-memory limit above the user's own hard limit "
                 "(`ulimit -Hl`), and starts the servers with that instead",
                 "raise the user's memlock hard limit (/etc/security/limits.conf: `USER hard memlock unlimited`, then "
                 'log in again), or use service_manager = "systemd-system"')
        # both sides on one host with SGLang's random --nccl-port: they can race onto the same one (EADDRINUSE at
        # start-up; SGLang's own PD test fixture pins a distinct --nccl-port per side; shared/reference/sglang-pd.md)
        for host in sorted({r.host for r in dep.prefill} & {r.host for r in dep.decode}):
            unset = [r for r in dep.prefill + dep.decode if r.host == host and r.nccl_port is None]
            if unset:
                first = unset[0]
                warn(f"{_role_field(dep, first)}.nccl_port",
                     f"prefill and decode share host {host!r} and {', '.join(_role_field(dep, r) for r in unset)} "
                     "leave --nccl-port to SGLang, which picks one at random on each side: both can pick the same "
                     "(EADDRINUSE at start-up)",
                     f"set nccl_port on each role of host {host!r}, e.g. nccl_port = {first.port + 100}")
        if facts is not None and facts.decode_layout_on_prefill:
            layouts = sorted({(r.tp, r.attn_dp) for r in dep.prefill + dep.decode})
            if len(layouts) > 1:
                where = ", ".join(f"{_role_field(dep, r)} tp {r.tp} attn_dp {r.attn_dp}" for r in dep.prefill + dep.decode)
                err("decode[0].tp",
                    f"prefill and decode run different layouts ({where}): SGLang {facts.version}'s prefill takes "
                    "decode's to be its own unless told with --disaggregation-decode-tp/-dp, which pdctl does not "
                    "render, and would send KV laid out for other ranks",
                    'give prefill and decode the same tp and attn_dp, or set sglang_version = "0.5.23" (decode '
                    "learns prefill's layout from its bootstrap server)")
        for i, d in enumerate(dep.decode):
            if d.bootstrap_port is not None:
                bps = {p.bootstrap_port or 8998 for p in dep.prefill}
                if d.bootstrap_port not in bps:
                    warn(
                        f"decode[{i}].bootstrap_port",
                        f"decode's fallback --disaggregation-bootstrap-port {d.bootstrap_port} matches no prefill "
                        f"bootstrap port {sorted(bps)} (used only when a request carries no bootstrap_port)",
                        "remove it, or set it to the prefill's bootstrap_port",
                    )
    elif dep.kv_transfer is not None:
        warn("kv_transfer", "a single-server deployment moves no KV between servers", "remove [kv_transfer]")

    # --- parsers --------------------------------------------------------------------------------
    base = dep.parsers
    for name, _kind, role in roles:
        f = _role_field(dep, role)
        if role.parsers is not None:
            for fld in ("reasoning_parser", "tool_call_parser", "chat_template"):
                mine, theirs = getattr(role.parsers, fld), getattr(base, fld)
                if mine != theirs:
                    err(
                        f"{f}.parsers.{fld}",
                        f"{name} would run {fld} = {mine!r} while the deployment sets {theirs!r}: prefill and "
                        "decode must parse and template identically (prefill samples the first token, decode the rest)",
                        f"remove {f}.parsers and set [parsers].{fld} once",
                    )
    if facts is not None:
        # free-text fields rendered as a choice flag: SGLang's argparse refuses another value (exit 2) at prefill_up,
        # after install, where the spec could have said so
        known_of = dict(facts.choices)
        for fld, value, flag in (("model.attention_backend", dep.model.attention_backend, "--attention-backend"),
                                 ("model.load_format", dep.model.load_format, "--load-format"),
                                 *((f"{_role_field(dep, r)}.kv_cache_dtype", r.kv_cache_dtype, "--kv-cache-dtype")
                                   for _n, _k, r in roles)):
            known = known_of.get(flag)
            if value is not None and known and value not in known:
                sparse = [f"model.dsa_{side}_backend" for side, names in zip(("prefill", "decode"), facts.dsa_backends)
                          if value in names] if flag == "--attention-backend" else []
                err(fld, f"{value!r} is not a {flag} choice of SGLang {facts.version}",
                    f"it is a sparse-attention backend: set {' or '.join(sparse)} = {value!r} instead (with "
                    'attention_backend = "dsa" or left out)' if sparse else _closest(f"{flag} choice", value, known))
        for fld, value, known in (("model.dsa_prefill_backend", dep.model.dsa_prefill_backend, facts.dsa_backends[0]),
                                  ("model.dsa_decode_backend", dep.model.dsa_decode_backend, facts.dsa_backends[1])):
            if value is not None and value not in known:  # SGLang exits 2 at prefill_up ("invalid choice")
                flag = f"{facts.sparse_attention_prefix}-{fld.split('_')[1]}-backend"
                err(fld, f"{value!r} is not a {flag} choice of SGLang {facts.version}",
                    _closest(f"{flag} choice", value, known))
        for fld in ("reasoning_parser", "tool_call_parser"):
            if getattr(base, fld) == "auto":  # one of SGLang's choices, which picks the parser at start-up
                fit = _deepseek_family(dep.model.path, _DEEPSEEK_TOOL_PARSERS if fld == "tool_call_parser"
                                       else _DEEPSEEK_REASONING_PARSERS)
                err(f"parsers.{fld}",
                    '"auto" leaves the choice to SGLang at start-up: pdctl needs the parser named, to check that '
                    "it fits the checkpoint and that prefill, decode and /server_info agree on it",
                    f'write {fld} = "{fit[1][0]}" ({fit[0]})' if fit else f"write the {fld.replace('_', '-')} "
                    "your checkpoint's markup needs")
        if base.reasoning_parser not in (None, "auto") and base.reasoning_parser not in facts.reasoning_parsers:
            err(
                "parsers.reasoning_parser",
                f"{base.reasoning_parser!r} is not a reasoning parser of SGLang {facts.version}",
                _closest("reasoning parser", base.reasoning_parser, facts.reasoning_parsers),
            )
        if base.tool_call_parser not in (None, "auto") and base.tool_call_parser not in facts.tool_call_parsers:
            err(
                "parsers.tool_call_parser",
                f"{base.tool_call_parser!r} is not a tool-call parser of SGLang {facts.version}",
                _closest("tool-call parser", base.tool_call_parser, facts.tool_call_parsers),
            )

        # A DeepSeek checkpoint's parsers: set, and fitting its markup (only what this SGLang version has: 0.5.6
        # has no deepseekv4), or parsers_configured fails after both servers restarted
        for fld, table, known, word, thing, verb, unset, misfit in _DEEPSEEK_PARSER_FIT:
            fit = _deepseek_family(dep.model.path, table)
            have = tuple(x for x in fit[1] if x in getattr(facts, known)) if fit else ()
            mine = getattr(base, fld)
            if not have:
                continue
            if mine is None:
                warn(f"parsers.{fld}",
                     f"{dep.model.path!r} is a {fit[0]} model and no {word} is set: {unset} {_FAILS_LATE}",
                     f'write [parsers] {fld} = "{have[0]}"')
            elif mine in getattr(facts, known) and mine not in have:
                warn(f"parsers.{fld}",
                     f"{dep.model.path!r} is a {fit[0]} model, whose {thing} SGLang {verb} {' or '.join(have)}: "
                     f"{mine!r} {misfit} {_FAILS_LATE}",
                     f'write {fld} = "{have[0]}" (or keep it, for a checkpoint with another format)')

    # --- extra args / env -----------------------------------------------------------------------
    for name, _kind, role in roles:
        f = _role_field(dep, role)
        refused: set[str] = set()  # (flags refused below on their own: their values are not judged again)
        known = facts.flags if facts is not None and facts.flags is not None else frozenset()
        for arg in role.extra_args:
            flag = _flag_name(arg)
            if flag is None or not _is_option(arg, known):  # (a value: "--x y" holds a space, argparse takes it so)
                continue
            refused.add(flag)
            if facts is not None:
                removed = facts.removed_flag(flag)
                if removed is not None:
                    since, repl = removed
                    err(
                        f"{f}.extra_args",
                        f"{flag} was removed in SGLang {since}; {facts.version} fails with 'unrecognized arguments'",
                        f"use {repl}" if repl else f"remove {flag}",
                    )
                    continue
            prefix_of = sorted(x for x in known if x.startswith(flag)) if flag not in known else []
            # (argparse takes an unambiguous abbreviation as the flag itself: judged as that flag, and said so)
            full = prefix_of[0] if len(prefix_of) == 1 else flag
            said = f"{flag} (an abbreviation of {full})" if full != flag else flag
            if full in _DP_REPLICA_FLAGS and facts is not None and facts.legacy_dp_attention:
                # (SGLang <= 0.5.20: pdctl renders attn_dp as --dp-size N --enable-dp-attention)
                err(f"{f}.extra_args", f"{said} is set by pdctl from attn_dp",
                    f"remove {flag} from extra_args and set attn_dp instead")
                continue
            if full in _DP_REPLICA_FLAGS:
                v = facts.version if facts is not None else dep.sglang_version
                err(
                    f"{f}.extra_args",
                    f"{said} is SGLang {v}'s number of data-parallel replicas of the model (not attention DP, "
                    "which pdctl renders from attn_dp as --attn-dp-size): each replica runs a whole TP group on GPUs "
                    "of its own behind this one port, which pdctl neither gives GPUs nor proves",
                    f"remove {flag}; pdctl runs one server per role group: for more replicas add [[prefill]] / "
                    "[[decode]] groups (the router balances them); for attention DP set attn_dp",
                )
                continue
            if full == "--enable-pd-role-switch":
                # shared/reference/sglang-pd.md §1.1: "runtime /pd_role_switch; starts a bootstrap server on every PD
                # instance → distinct bootstrap ports needed on one host"; SGLang 0.5.23 --help: "Allow runtime
                # prefill<->decode role switch via /pd_role_switch (PD mode)." pdctl passes a decode server
                # --disaggregation-bootstrap-port only where its role sets bootstrap_port (launch._bootstrap_port)
                err(
                    f"{f}.extra_args",
                    f"{said} lets SGLang switch this server between prefill and decode at runtime (POST "
                    "/pd_role_switch), which pdctl's fixed topology (the router's --prefill/--decode lists, the "
                    "proofs of each role) does not follow; and it starts a bootstrap server on every PD server, "
                    "decode too, on its --disaggregation-bootstrap-port (for a decode role without bootstrap_port, "
                    "SGLang's default 8998, which a prefill on the same host binds by default), a port pdctl neither "
                    "assigns nor checks",
                    f"remove {flag}; to move GPUs between prefill and decode, edit the [[prefill]] / [[decode]] "
                    "groups and apply",
                )
                continue
            if full == "--skip-tokenizer-init":
                parsers = role.parsers or dep.parsers
                where = f"{f}.parsers" if role.parsers is not None else "parsers"
                set_ = [f"{where}.{x}" for x in ("reasoning_parser", "tool_call_parser", "chat_template")
                        if getattr(parsers, x) is not None]
                if set_:
                    # shared/reference/sglang-pd.md §1.2: "requests must carry input_ids; OpenAI chat/parsers
                    # unusable → not for a parser-enabled deployment" (SGLang 0.5.23 --help: "skip init tokenizer
                    # and pass input_ids in generate request")
                    err(
                        f"{f}.extra_args",
                        f"{said} starts the server without a tokenizer: requests must carry input_ids, and the "
                        f"OpenAI chat API, chat template and parsers are unusable, while {', '.join(set_)} "
                        f"{'is' if len(set_) == 1 else 'are'} set {_FAILS_LATE}",
                        f"remove {flag}, or remove {' and '.join(set_)}",
                    )
                    continue
                if dep.is_pd:
                    # (the same §1.2: no text in, no text out; kv_link_verified proves the link with one paired
                    # /generate request of text, and reads the text decode answers)
                    err(
                        f"{f}.extra_args",
                        f"{said} starts the server without a tokenizer: it takes input_ids and answers output_ids "
                        "only, while kv_link_verified proves the KV link with a paired /generate request of text "
                        "and reads decode's text (kv_link_verified then fails, after both servers restarted)",
                        f"remove {flag}",
                    )
                    continue
            if full in _OWNED_SERVER_FLAGS:
                source = _OWNED_SERVER_FLAGS[full]
                always = source.startswith("(")  # (a flag pdctl always passes: nothing of the spec sets it)
                err(
                    f"{f}.extra_args",
                    f"{said} is always passed by pdctl" if always else f"{said} is set by pdctl from {source}",
                    f"remove {flag} from extra_args" + ("" if always else f" and set {source} instead"),
                )
                continue
            if full == "--api-key":
                err(
                    f"{f}.extra_args",
                    f"{said} makes the server answer 401 to the requests pdctl's steps prove it with (/server_info, "
                    "/generate, the chat check), which carry no key: prefill_up would fail after the servers "
                    "restarted; and extra_args are written into the unit in plain text",
                    f"remove {flag}; keep the servers on a private address and expose only the router",
                )
                continue
            if full in _ONE_HOST_FLAGS:
                err(
                    f"{f}.extra_args",
                    f"{said} spreads a server over several nodes: pdctl runs each role on one host, and checks and proves "
                    "its NCCL port (nccl_port), which --dist-init-addr would replace with a rendezvous port nothing "
                    "checks (SGLang 0.5.23 derives its other internal ports from it too)",
                    f"remove {flag}; give the role more GPUs of its host, or another [[prefill]] / [[decode]] group",
                )
                continue
            if full == "--help":
                err(f"{f}.extra_args", f"{said} makes SGLang print its help and exit: the server would not start",
                    f"remove {flag}")
                continue
            if facts is not None and facts.flags is not None and flag not in facts.flags:
                # (argparse takes an unambiguous prefix of a flag too; a later release's new flag can make it ambiguous)
                some = ", ".join(prefix_of[:4]) + ("…" if len(prefix_of) > 4 else "")
                err(
                    f"{f}.extra_args",
                    f"{flag} is not a launch_server flag of SGLang {facts.version}" + (
                        f", only an abbreviation of {prefix_of[0]}, which a later release can make ambiguous"
                        if len(prefix_of) == 1 else
                        f", only a prefix of {some} (argparse: 'ambiguous option')" if prefix_of else ""),
                    f"write {prefix_of[0]} in full" if len(prefix_of) == 1 else
                    "check the spelling against `python -m sglang.launch_server --help`",
                )
                continue
            refused.discard(flag)
        if facts is not None and facts.arguments:
            for message, fix in _launch_arg_faults(list(role.extra_args), facts, refused):
                err(f"{f}.extra_args", message, fix)
    # What pdctl sets in the units' environment, no table of the spec sets: the servers' variables (a secret too: one
    # more variable, and the last written, it would override them), and the process supervisor's marks on every
    # role's process, the router's included (how status and down find it)
    tables = [*((f"{_role_field(dep, role)}.env", role.env) for _n, _k, role in roles), ("engine.env", dep.engine.env),
              ("secrets", dep.secrets), ("router.env", dep.router.env if dep.router else {})]
    for where, table in tables:
        for key in table:
            if key in _OWNED_ENV and where != "router.env":
                err(f"{where}.{key}", f"{key} is set by pdctl from {_OWNED_ENV[key]}",
                    f"remove it and set {_OWNED_ENV[key].split(' (')[0]}")
            elif key in _SUPERVISOR_ENV:
                err(f"{where}.{key}", f"{key} is set by pdctl's process supervisor on every role's process: "
                                      "status and down find the role by it", "remove it")
            elif key in _KERNELS_ENV and dep.kernels.enabled and where != "router.env":
                err(f"{where}.{key}", f"{key} is set by pdctl while [kernels] is enabled: {_KERNELS_ENV[key]}",
                    "remove it")
            elif (key == "UCX_NET_DEVICES" and where != "router.env" and dep.kv_transfer is not None
                  and dep.kv_transfer.ucx_net_devices is not None):
                warn(f"{where}.{key}", f"overrides kv_transfer.ucx_net_devices = "
                                       f"{dep.kv_transfer.ucx_net_devices!r} for "
                                       f"{where.removesuffix('.env') if where.endswith('].env') else 'every role'}",
                     "set the devices in one place: kv_transfer.ucx_net_devices for every role, or each role's "
                     "env.UCX_NET_DEVICES (e.g. the NICs of its NUMA node) and no kv_transfer.ucx_net_devices")

    # --- the account the roles run as --------------------------------------------------------------------
    if dep.service_user is not None and dep.service_manager == "systemd-user":
        err("service_user", f"service_user = {dep.service_user!r} cannot apply under systemd-user: a user manager "
            "runs every unit as its own user, who runs pdctl",
            'set service_manager = "systemd-system" (or "process") and run pdctl as root, or leave service_user '
            "unset and run pdctl as that account")

    # --- executables: the units' first argument is an absolute path ---------------------------------------
    if dep.engine.python is not None and not dep.engine.python.startswith("/"):
        err("engine.python", f"{dep.engine.python!r} is not an absolute path: the units start it as their first "
            "argument, on the host, from no particular directory",
            "write the interpreter's absolute path on the host (`command -v python3` there, or the venv's bin/python)")
    if dep.model.path.startswith(("./", "../", "~")):  # (a bare "org/name" is a Hugging Face id, not a path)
        err("model.path", f"{dep.model.path!r} is a relative path: the servers start from no particular directory "
            "(and no shell expands ~ in a unit)", "write the checkpoint's absolute path on the host, or its Hugging "
            "Face id (org/name)")
    if dep.engine.cache_dir is not None and not dep.engine.cache_dir.startswith("/"):
        err("engine.cache_dir", f"{dep.engine.cache_dir!r} is not an absolute path: the servers (SGLANG_CACHE_DIR) and "
            "the kernels' build would each read it from whatever directory they start in",
            "write its absolute path on the host, e.g. /var/cache/sglang")
    exe = dep.router.executable if dep.router is not None else None
    if exe is not None and "/" in exe and not exe.startswith("/"):
        err("router.executable", f"{exe!r} is a relative path: the router's unit starts it from no particular "
            "directory", "write its absolute path, or a bare name that is on PATH where pdctl runs (`smg`)")

    # --- memory -------------------------------------------------------------------------------
    for _name, _kind, role in roles:
        if role.mem_fraction is not None and role.mem_fraction >= _MEM_FRACTION_WARN:
            warn(
                f"{_role_field(dep, role)}.mem_fraction",
                f"mem_fraction = {role.mem_fraction:g} gives weights and the KV pool (SGLang's --mem-fraction-static) "
                "almost all GPU memory, leaving almost none for activations, CUDA graphs and NCCL buffers",
                "leave mem_fraction unset so that SGLang derives it, or lower it (e.g. 0.85)",
            )

    # --- engines reachable around the router ----------------------------------------------------
    if dep.router is not None:
        for name, _kind, role in roles:
            if is_wildcard(role.http_host):
                warn(
                    f"{_role_field(dep, role)}.http_host",
                    f"{name} binds every interface ({role.http_host}): clients can reach the engine directly, around "
                    f"the router on {url_host(dep.router.host)}:{dep.router.port}",
                    "bind it to 127.0.0.1 (prefill, decode and the router share one host); expose the router only",
                )

    # --- secrets --------------------------------------------------------------------------------
    tables = [("engine.env", dep.engine.env), ("router.env", dep.router.env if dep.router else {})]
    tables += [(f"{_role_field(dep, r)}.env", r.env) for _n, _k, r in roles]
    for where, env in tables:
        for key, value in env.items():
            # (env tables take values as written: no env:NAME here)
            if is_secret_env(key, value):
                warn(
                    f"{where}.{key}",
                    f"{key} looks like a secret, and env values are written into unit files and plans in clear",
                    f'move it to [secrets] ({key} = "env:{key}"): written 0600 and shown as ***',
                )
    getters = [n for n, _k, _r in roles] + (["router"] if dep.router is not None else [])
    for key, entry in dep.secrets.items():
        # an empty value would reach the servers as an empty variable (a model download failing minutes later);
        # apply refuses it, so validate says so first
        where = f"secrets.{key}" if isinstance(entry, str) else f"secrets.{key}.value"
        if not dep.secret_refs()[key].strip():
            err(where, "the value is empty", f'write "env:{key}" and export {key} where pdctl runs, or remove it')
        if not isinstance(entry, str):
            repeated = sorted({r for r in entry.roles if entry.roles.count(r) > 1})
            if repeated:
                warn(f"secrets.{key}.roles", f"{', '.join(repeated)} listed more than once",
                     "list each role or kind once")
    for key in dep.secrets:
        if dep.secret_scoped(key) and not any(key in dep.secrets_for(n) for n in getters):
            warn(f"secrets.{key}.roles", f"no role of this spec gets it (roles = {dep.secrets[key].roles!r})",  # type: ignore[union-attr]
                 f"name the roles that need it ({', '.join(getters)}), or remove it")
    for key, value in dep.secret_refs().items():
        if value and not value.startswith("env:"):
            warn(
                f"secrets.{key}",
                "the value sits in the spec file in plain text (and in every copy of it)",
                f'write "env:{key}" and export {key} where pdctl runs',
            )

    # --- DeepSeek-V4: SGLang's own dsv4 attention, whatever the dsa flags say ---------------------
    v4 = _deepseek_attention(dep.model.path) == "dsv4"
    if v4:
        sized: set[str] = set()
        for _name, _kind, role in roles:
            field = f"{_role_field(dep, role)}.page_size" if role.page_size is not None else "model.page_size"
            size = role.page_size if role.page_size is not None else dep.model.page_size
            if size not in (None, _DSV4_PAGE_SIZE) and field not in sized:
                sized.add(field)
                err(
                    field,
                    f"page_size = {size} for {dep.model.path}: SGLang serves DeepSeek-V4 with its dsv4 attention "
                    f"backend in {_DSV4_PAGE_SIZE}-token pages whatever --page-size says, and /server_info would "
                    f"show {_DSV4_PAGE_SIZE} (prefill_up then fails on the real server)",
                    f"leave {field} out, or set it to {_DSV4_PAGE_SIZE}",
                )
        kv_said: set[str] = set()
        for _name, _kind, role in roles:
            field = f"{_role_field(dep, role)}.kv_cache_dtype" if role.kv_cache_dtype is not None else "model.kv_cache_dtype"
            kv = role.kv_cache_dtype if role.kv_cache_dtype is not None else dep.model.kv_cache_dtype
            if kv not in _DSV4_KV_DTYPES and field not in kv_said:
                kv_said.add(field)
                err(
                    field,
                    f"kv_cache_dtype = {kv!r} for {dep.model.path}: SGLang accepts fp8_e4m3 or bfloat16 (auto: fp8_e4m3) "
                    "for DeepSeek-V4 and stops the server at start otherwise (an AssertionError)",
                    'write "fp8_e4m3", "bfloat16" (spelled out: "bf16" is refused for V4) or "auto"',
                )
        for fld in ("dsa_prefill_backend", "dsa_decode_backend"):
            if getattr(dep.model, fld) is not None:
                warn(
                    f"model.{fld}",
                    f"SGLang serves {dep.model.path} (DeepSeek-V4) with its dsv4 attention backend, which never reads "
                    f"--{fld.replace('_', '-')}",
                    f"leave model.{fld} out (dsv4's own choices go in extra_args: --dsv4-attn-backend, "
                    "--dsv4-prefill-backend)",
                )
    # --- kernels --------------------------------------------------------------------------------
    if dep.kernels.enabled and v4:
        _v4_kernel_findings(dep, roles, facts, err, warn)
    elif dep.kernels.enabled:
        paged: set[str] = set()  # model.page_size is reported once, not once per role that inherits it
        for _name, _kind, role in roles:
            if role.page_size is not None and role.page_size != _KERNEL_PAGE_SIZE:
                field, size = f"{_role_field(dep, role)}.page_size", role.page_size
            elif role.page_size is None and dep.model.page_size not in (None, _KERNEL_PAGE_SIZE):
                field, size = "model.page_size", dep.model.page_size
            else:
                continue
            if field not in paged:
                paged.add(field)
                err(
                    field,
                    f"page_size = {size} with kernels enabled: pdctl's kernels read 64-token pages (the FP8 "
                    "656-byte latent KV and the indexer's 132 B/token index cache)",
                    f"set {field} = 64 (or leave it out), or set kernels.enabled = false",
                )
    if dep.kernels.enabled and not dep.kernels.which:
        err("kernels.which", "kernels are enabled but none is named: kernels_built would build nothing",
            'name them (which = ["sparse_mla_decode", "lightning_indexer"]), or set kernels.enabled = false')
    if dep.kernels.enabled and not v4 and "sparse_mla_decode" in dep.kernels.which:
        if dep.model.dsa_decode_backend not in _PLUGIN_DECODE_BACKENDS:
            err(
                "model.dsa_decode_backend",
                f"{'not set' if dep.model.dsa_decode_backend is None else repr(dep.model.dsa_decode_backend)}: pdctl's "
                "sparse-MLA decode kernel is routed in only on SGLang's "
                f"{' / '.join(_PLUGIN_DECODE_BACKENDS)} decode paths; with this backend the built kernel would never run",
                'set model.dsa_decode_backend = "flashmla_kv" (FP8 KV) or "flashmla_sparse", or drop sparse_mla_decode from kernels.which',
            )
    if dep.kernels.enabled and dep.sglang_version not in _PLUGIN_VERSIONS:
        err(
            "kernels.enabled" if not v4 else "sglang_version",
            f"pdctl's SGLang plugin knows SGLang {', '.join(_PLUGIN_VERSIONS)} only and refuses {dep.sglang_version}"
            + (" (its DeepSeek-V4 hooks are read from 0.5.23's dsv4 backend)" if v4 else ""),
            'target SGLang 0.5.23 (sglang_version = "0.5.23"), or set kernels.enabled = false',
        )

    # --- the model: what it cannot do in PD, deprecated names (pdctl.statemachine.model_rules) -----------------
    from pdctl.statemachine.model_rules import model_findings

    out += model_findings(dep)

    out.sort(key=lambda x: 0 if x.level == "error" else 1)
    return out


def _v4_kernel_findings(dep: Deployment, roles, facts, err, warn) -> None:  # noqa: ANN001
    """What [kernels] enabled means for a DeepSeek-V4 checkpoint: pdctl's SGLang plugin hooks SGLang 0.5.23's dsv4
    backend (``pdctl.kernels.sglang_plugin``: ``flash_mla_with_kvcache`` for decode, ``flash_mla_with_kvcache_sm120``
    on sm_120 GPUs, ``forward_c4_indexer`` for the C4 indexer) on the 584-byte V4 rows, so the spec must run that
    backend the way the hooks read it: the flashmla sub-backend, a V4 (not V4.1) checkpoint pdctl knows the heads and
    top-k of, the FP8 indexer for lightning_indexer.
    (The version is judged with V3.2's, in :func:`validate`.)"""
    from pdctl.statemachine.models import builtin_facts

    name = dep.model.path.rstrip("/").rsplit("/", 1)[-1]
    if re.search(r"v4[._-]?1", name.lower()):
        err(
            "kernels.enabled",
            f"{dep.model.path} is a DeepSeek-V4.1 checkpoint: pdctl's V4 kernels are built and verified for "
            "DeepSeek-V4-Flash and V4-Pro, and SGLang runs V4.1 on its own paths where the GPU has them (the V4.1 "
            "cache layouts and flashmla_mega on SM100: deepseek_v4_memory_pool.py select_dsv4_kv_layout), whose calls "
            "the plugin passes to SGLang's kernels",
            "set kernels.enabled = false for this model; the kernels serve DeepSeek-V4-Flash / V4-Pro and V3.2",
        )
        return
    model = builtin_facts(dep.model.path)
    if model is None or not model.num_attention_heads or not model.index_topk:
        err(
            "model.path",
            f"pdctl knows no head count and index top-k for {dep.model.path}: kernels_built builds and verifies the V4 "
            "kernels at the deployment's local heads (num_attention_heads / attention TP) and top-k",
            "name the checkpoint as DeepSeek publishes it (a path ending in DeepSeek-V4-Flash or DeepSeek-V4-Pro), "
            "or set kernels.enabled = false",
        )
    kv_said: set[str] = set()
    for _name, _kind, role in roles:
        field = f"{_role_field(dep, role)}.kv_cache_dtype" if role.kv_cache_dtype is not None else "model.kv_cache_dtype"
        kv = role.kv_cache_dtype if role.kv_cache_dtype is not None else dep.model.kv_cache_dtype
        if kv == "bfloat16" and field not in kv_said:
            kv_said.add(field)
            warn(
                field,
                "kv_cache_dtype = 'bfloat16' with kernels enabled: SGLang 0.5.23 keeps DeepSeek-V4's cache in the "
                "584-byte FP8 V4 rows on CUDA whatever the dtype (mem_cache/deepseek_v4_memory_pool.py, KVLayout.V4), "
                "and those are what pdctl's V4 kernels read and kernels_built verifies; the spec says bf16",
                f'write {field} = "fp8_e4m3" (or "auto"): the cache the servers really keep',
            )
    for _name, _kind, role in roles:
        f = _role_field(dep, role)
        given = _given(list(role.extra_args), facts)
        backend = given.get("--dsv4-attn-backend")
        if backend is not None and backend not in _PLUGIN_DSV4_ATTN_BACKENDS:
            err(
                f"{f}.extra_args",
                f"--dsv4-attn-backend {backend}: pdctl's kernels are routed in only on SGLang's flashmla DeepSeek-V4 "
                "attention (flash_mla_with_kvcache, or flash_mla_with_kvcache_sm120 on sm_120); with this backend they "
                "would be built and never run",
                "remove --dsv4-attn-backend (auto is flashmla for V4) or give flashmla, or set kernels.enabled = false",
            )
        if given.get("--enable-deepseek-v4-fp4-indexer") is True and "lightning_indexer" in dep.kernels.which:
            warn(
                f"{f}.extra_args",
                "--enable-deepseek-v4-fp4-indexer: the C4 indexer then keeps FP4 index keys (68 B a row), and pdctl's "
                "lightning_indexer reads the FP8 ones (132 B): the plugin passes every indexer call to SGLang's own FP4 "
                "indexer (it logs the fallback once), so only the decode kernel runs",
                "remove --enable-deepseek-v4-fp4-indexer to run pdctl's indexer, or drop lightning_indexer from "
                "kernels.which",
            )


def _closest(what: str, value: str, names: frozenset[str], *, where: str = "the target version") -> str:
    import difflib

    near = difflib.get_close_matches(value, sorted(names), n=3, cutoff=0.6)  # 0.5 offered 'nanbeige' for 'nonsense'
    every = f"use a {what} {where} has: {', '.join(sorted(names))}"
    return f"did you mean {' or '.join(repr(n) for n in near)}? Or {every}" if near else every


def check(dep: Deployment, *, inventories: dict[str, Inventory] | None = None) -> list[Finding]:
    """Validate *dep*; raise :class:`SpecError` listing every error. Returns the warnings."""
    findings = validate(dep, inventories=inventories)
    errors = [f for f in findings if f.level == "error"]
    if errors:
        body = "\n  ".join(f"{f.field}: {f.message}\n    fix: {f.fix}" for f in errors)
        raise SpecError(f"spec {dep.name!r} breaks {len(errors)} rule(s):\n  {body}", findings=findings)
    return [f for f in findings if f.level == "warning"]

