"""The stand-in "model": a deterministic tokenizer, chat template and text generator.

Nothing here is learned; every output is a pure function of the prompt's token ids (through the
KV digest), so a prefill-decode pair and a collapsed server give the same text for the same
prompt, and a decode server can only produce it from KV it actually received.

Markup is the model family's native format, as SGLang 0.5.23's parsers expect it:

* ``deepseek-v32`` (default): DeepSeek-V3.2 chat template (``<｜User｜>``/``<｜Assistant｜>``; the
  template ends the prompt with ``<think>`` when ``chat_template_kwargs.thinking`` is true, else
  ``</think>``), reasoning ends with ``</think>``, tool calls in DSML ``<｜DSML｜function_calls>``
  markup (``sglang/srt/function_call/deepseekv32_detector.py``).
* ``deepseek-v32-exp``: DeepSeek-V3.2-Exp, the same sparse-attention architecture, with V3.1's tool-call
  markup (SGLang's docs/basic_usage/deepseek_v32.md: ``--tool-call-parser deepseekv31`` for V3.2-Exp).
* ``deepseek-v4``: same thinking tokens, DSML ``<｜DSML｜tool_calls>`` markup
  (``function_call/deepseekv4_detector.py``).
* ``deepseek-v41``: V4.1's DSML, whose tag names begin with a space (``<｜DSML｜ calls>``,
  ``<｜DSML｜ invoke …>``, ``<｜DSML｜ parameter …>``; ``function_call/deepseekv41_detector.py``).
* ``deepseek-v31``: ``<｜tool▁calls▁begin｜>…<｜tool▁sep｜>{json}…`` markup
  (``function_call/deepseekv31_detector.py``).
* ``deepseek-v3`` (V3) and ``deepseek-r1`` (R1, which always thinks): ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``
  and the arguments in a ```` ```json ```` block (``function_call/deepseekv3_detector.py``).

The family follows the model (see ``model_family``); ``PDCTL_SIM_MODEL_FAMILY`` overrides it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("deepseek-v32", "deepseek-v32-exp", "deepseek-v4", "deepseek-v41", "deepseek-v31", "deepseek-v3",
            "deepseek-r1")
DEFAULT_FAMILY = "deepseek-v32"
#: Each family's architecture: (config.json model_type, architecture class); the DSA ones get SGLang's DSA overrides.
ARCHITECTURE = {"deepseek-v32": ("deepseek_v32", "DeepseekV32ForCausalLM"),
                "deepseek-v32-exp": ("deepseek_v32", "DeepseekV32ForCausalLM"),
                "deepseek-v4": ("deepseek_v4", "DeepseekV4ForCausalLM"),
                "deepseek-v41": ("deepseek_v4", "DeepseekV4ForCausalLM"),
                "deepseek-v31": ("deepseek_v3", "DeepseekV3ForCausalLM"),
                "deepseek-v3": ("deepseek_v3", "DeepseekV3ForCausalLM"),
                "deepseek-r1": ("deepseek_v3", "DeepseekV3ForCausalLM")}
DSA_FAMILIES = frozenset(f for f, (mt, _) in ARCHITECTURE.items() if mt == "deepseek_v32")
ALWAYS_THINKS = frozenset({"deepseek-r1"})
#: What SGLang 0.5.23 resolves an unset --page-size to for the family on CUDA
#: (model_overrides/deepseek_v2.py: DSA -> 64; deepseek_v4.py -> 256; V3/V3.1 -> 1).
DSV4_PAGE_SIZE = 256  # model_overrides/deepseek_v4.py on CUDA, whatever --page-size says
DEFAULT_PAGE_SIZE = {f: {"deepseek_v32": 64, "deepseek_v4": DSV4_PAGE_SIZE}.get(mt, 1)
                     for f, (mt, _) in ARCHITECTURE.items()}
VOCAB_SIZE = 129280  # DeepSeek-V3 family vocabulary size

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"

_WORDS = (
    "the request asks about a small system that routes work between two servers and the answer "
    "depends on how the cache moves from one side to the other so we check the pages the bytes "
    "the order and the timing before we reply with a short clear summary of what happens next"
).split()
_TOKEN_RE = re.compile(r"<｜[^｜]*｜>|<｜DSML｜|</?think>|\w+|[^\w\s]|\s+")


_MODEL_TYPES = {"deepseek_v32": "deepseek-v32", "deepseek_v4": "deepseek-v4", "deepseek_v3": "deepseek-v31"}
# Checkpoint names as DeepSeek publishes them -> family; first match wins (a local config.json's model_type only
# tells the architecture, so a name inside it still picks the markup).
_NAMES = ((r"v4[._-]?1", "deepseek-v41"), (r"v4", "deepseek-v4"), (r"v3[._-]?2[._-]?exp", "deepseek-v32-exp"),
          (r"v3[._-]?2", "deepseek-v32"), (r"v3[._-]?1", "deepseek-v31"), (r"r1", "deepseek-r1"),
          (r"v3", "deepseek-v3"))


def model_family(model_path: str | None = None) -> str:
    """The family whose markup the stand-in emits.

    ``PDCTL_SIM_MODEL_FAMILY`` wins; else, as SGLang reads the architecture from the checkpoint's
    ``config.json``, a local ``MODEL_PATH/config.json`` ``model_type`` decides the architecture (and the
    name, within it, the markup); else the model name (``...V4.1...`` -> deepseek-v41, ``...V4...`` ->
    deepseek-v4, ``...V3.2-Exp...`` -> deepseek-v32-exp, ``...V3.2...`` -> deepseek-v32, ``...V3.1...`` ->
    deepseek-v31, ``...R1...`` -> deepseek-r1, ``...V3...`` -> deepseek-v3); else deepseek-v32."""
    fam = os.environ.get("PDCTL_SIM_MODEL_FAMILY", "").strip().lower()
    if fam:
        if fam not in FAMILIES:
            raise SystemExit(f"PDCTL_SIM_MODEL_FAMILY must be one of {', '.join(FAMILIES)}; got {fam!r}")
        return fam
    if not model_path:
        return DEFAULT_FAMILY
    name = os.path.basename(model_path.rstrip("/")).lower()
    by_name = next((fam for pattern, fam in _NAMES if re.search(pattern, name)), None)
    cfg = os.path.join(model_path, "config.json")
    if os.path.isfile(cfg):
        try:
            with open(cfg, encoding="utf-8") as f:
                mt = json.load(f).get("model_type")
            if mt in _MODEL_TYPES:
                return by_name if by_name and ARCHITECTURE[by_name][0] == mt else _MODEL_TYPES[mt]
        except (OSError, ValueError, AttributeError):
            pass
    return by_name or DEFAULT_FAMILY


def tokenize(text: str) -> list[int]:
    """A deterministic stand-in tokenizer: word pieces hashed into the vocabulary."""
    return [zlib.crc32(p.encode("utf-8")) % VOCAB_SIZE for p in _TOKEN_RE.findall(text)]


def kv_digest(input_ids: list[int]) -> str:
    """What prefill "computes" for a prompt: a digest standing in for the KV cache."""
    h = hashlib.sha256()
    for t in input_ids:
        h.update(int(t).to_bytes(4, "little", signed=False))
    return h.hexdigest()


def render_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                thinking: bool) -> str:
    """DeepSeek-V3.2-style chat template (tools described in the system turn)."""
    parts = [BOS]
    system = [m for m in messages if m.get("role") == "system"]
    for m in system:
        parts.append(_content_text(m.get("content")))
    if tools:
        parts.append("\n\n## Tools\nYou have access to these tools:\n")
        for t in tools:
            fn = t.get("function", t)
            parts.append(json.dumps(fn, sort_keys=True, ensure_ascii=False) + "\n")
    for m in messages:
        role = m.get("role")
        if role == "system":
            continue
        if role == "user":
            parts.append(USER + _content_text(m.get("content")))
        elif role == "assistant":
            parts.append(ASSISTANT + THINK_END + _content_text(m.get("content")) + EOS)
        elif role == "tool":
            parts.append("<｜tool▁output▁begin｜>" + _content_text(m.get("content")) + "<｜tool▁output▁end｜>")
        else:
            parts.append(_content_text(m.get("content")))
    parts.append(ASSISTANT + (THINK_START if thinking else THINK_END))
    return "".join(parts)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(c.get("text", "") for c in content if isinstance(c, dict))
    return str(content)


class _Rng:
    """A tiny deterministic stream of numbers seeded by the KV digest."""

    def __init__(self, seed: str) -> None:
        self._seed = seed.encode()
        self._n = 0
        self._buf = b""

    def next(self) -> int:
        if not self._buf:
            self._buf = hashlib.sha256(self._seed + self._n.to_bytes(8, "little")).digest()
            self._n += 1
        v, self._buf = int.from_bytes(self._buf[:4], "little"), self._buf[4:]
        return v

    def word(self) -> str:
        return _WORDS[self.next() % len(_WORDS)]

    def words(self, n: int) -> list[str]:
        return [self.word() for _ in range(n)]


@dataclass
class Generation:
    """The full text the model would emit, split into output "tokens" (pieces)."""

    pieces: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _sentence(rng: _Rng, n: int) -> list[str]:
    ws = rng.words(n)
    ws[0] = ws[0].capitalize()
    out = [ws[0]] + [" " + w for w in ws[1:]]
    out[-1] = out[-1] + "."
    return out


def example_for_schema(schema: Any, rng: _Rng, depth: int = 0) -> Any:
    """A value satisfying a JSON schema (the subset tool definitions use)."""
    if not isinstance(schema, dict):
        return rng.word()
    if "const" in schema:
        return schema["const"]
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema and schema[key]:
            return example_for_schema(schema[key][0], rng, depth)
    if "default" in schema:
        return schema["default"]
    typ = schema.get("type")
    if isinstance(typ, list):
        typ = next((t for t in typ if t != "null"), typ[0] if typ else "string")
    if typ is None:
        typ = "object" if "properties" in schema else "string"
    if typ == "object":
        props = schema.get("properties") or {}
        required = schema.get("required") or list(props)
        if depth > 4:
            return {}
        return {k: example_for_schema(props.get(k, {}), rng, depth + 1) for k in required}
    if typ == "array":
        n = max(int(schema.get("minItems", 1)), 1)
        if "maxItems" in schema:
            n = min(n, int(schema["maxItems"]))
        return [example_for_schema(schema.get("items", {}), rng, depth + 1) for _ in range(n)]
    if typ in ("integer", "number"):
        lo = schema.get("minimum", schema.get("exclusiveMinimum", 0))
        hi = schema.get("maximum", schema.get("exclusiveMaximum", lo + 100))
        lo_i, hi_i = int(lo) + (1 if "exclusiveMinimum" in schema else 0), int(hi)
        if hi_i < lo_i:
            hi_i = lo_i
        v = lo_i + rng.next() % (hi_i - lo_i + 1)
        if "exclusiveMaximum" in schema and v >= schema["exclusiveMaximum"]:
            v = lo_i
        return v if typ == "integer" else float(v)
    if typ == "boolean":
        return bool(rng.next() % 2)
    if typ == "null":
        return None
    # string
    fmt = schema.get("format")
    if fmt == "date":
        return "2026-01-01"
    if fmt == "date-time":
        return "2026-01-01T00:00:00Z"
    s = rng.word().capitalize()
    min_len = int(schema.get("minLength", 0))
    while len(s) < min_len:
        s += rng.word()
    if "maxLength" in schema:
        s = s[: int(schema["maxLength"])] or s[:1]
    return s


def tool_call_markup(family: str, name: str, args: dict[str, Any]) -> list[str]:
    """The model-native markup for one tool call, as output pieces."""
    if family in ("deepseek-v31", "deepseek-v32-exp"):
        return ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", name, "<｜tool▁sep｜>",
                json.dumps(args, ensure_ascii=False), "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"]
    if family in ("deepseek-v3", "deepseek-r1"):
        return ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "function", "<｜tool▁sep｜>", name, "\n```json\n",
                json.dumps(args, ensure_ascii=False), "\n```", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"]
    from pdctl.sim.parsers import DSML_TAGS

    block, invoke, param = DSML_TAGS[{"deepseek-v32": "deepseekv32", "deepseek-v41": "deepseekv41"}.get(
        family, "deepseekv4")]
    pieces = [f"<｜DSML｜{block}>", "\n", f'<｜DSML｜{invoke} name="{name}">', "\n"]
    for k, v in args.items():
        if isinstance(v, str):
            pieces.append(f'<｜DSML｜{param} name="{k}" string="true">{v}</｜DSML｜{param}>')
        else:
            pieces.append(
                f'<｜DSML｜{param} name="{k}" string="false">{json.dumps(v, ensure_ascii=False)}'
                f"</｜DSML｜{param}>"
            )
        pieces.append("\n")
    pieces += [f"</｜DSML｜{invoke}>", "\n", f"</｜DSML｜{block}>"]
    return pieces


def generate(digest: str, *, family: str, chat: bool, thinking: bool,
             tools: list[dict[str, Any]] | None, tool_choice: Any = "auto") -> Generation:
    """Everything the model emits for a prompt whose KV digest is ``digest`` (before max_tokens)."""
    rng = _Rng(digest)
    g = Generation()
    if chat and (thinking or family in ALWAYS_THINKS):
        # The template put <think> in the prompt; the model reasons, then closes the block.
        g.pieces += _sentence(rng, 8 + rng.next() % 5) + [" "] + _sentence(rng, 6)
        g.pieces.append(THINK_END)
    call_tool = bool(chat and tools and tool_choice != "none")
    if call_tool:
        tool = tools[0] if isinstance(tool_choice, (str, type(None))) else _chosen(tools, tool_choice)
        fn = tool.get("function", tool)
        args = example_for_schema(fn.get("parameters") or {"type": "object", "properties": {}}, rng)
        if not isinstance(args, dict):
            args = {}
        g.pieces += tool_call_markup(family, fn.get("name", "tool"), args)
    else:
        g.pieces += _sentence(rng, 10 + rng.next() % 8)
    return g


def _chosen(tools: list[dict[str, Any]], tool_choice: Any) -> dict[str, Any]:
    try:
        name = tool_choice["function"]["name"]
    except (TypeError, KeyError):
        return tools[0]
    for t in tools:
        if t.get("function", t).get("name") == name:
            return t
    return tools[0]


def first_token_id(digest: str) -> int:
    """The first output token prefill samples and hands to decode with the KV."""
    return int(digest[:8], 16) % VOCAB_SIZE


def piece_id(piece: str) -> int:
    """The token id of one output piece."""
    return zlib.crc32(piece.encode("utf-8")) % VOCAB_SIZE
