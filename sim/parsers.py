"""Reasoning and tool-call parsing, mirrored from SGLang 0.5.23 for the markup the stand-in emits.

* ``sglang/srt/parser/reasoning_parser.py``: ``ReasoningParser.DetectorMap``. ``deepseek-v3`` is a
  Qwen3-style ``<think>``/``</think>`` detector with ``reasoning_default="explicit_thinking"`` (reasoning
  is forced only when the request sets ``chat_template_kwargs: {"thinking": true}``); ``deepseek-v4`` /
  ``deepseek-v41`` use ``DeepSeekV4Detector`` (same tokens, also explicit_thinking); ``deepseek-r1``,
  ``step3``, ``step3p5`` force reasoning always; ``qwen3``, ``dots``, ``minimax``, ``nanbeige`` only
  reason when ``<think>`` appears in the output.  ``BaseReasoningFormatDetector.detect_and_parse``:
  text up to ``</think>`` is reasoning, the rest (stripped) is content; no ``</think>`` while forced
  means all of it is reasoning (truncated).
* ``sglang/srt/function_call/deepseekv32_detector.py`` (``<｜DSML｜function_calls>``),
  ``deepseekv4_detector.py`` (``<｜DSML｜tool_calls>``), ``deepseekv41_detector.py`` (``<｜DSML｜ calls>``: its
  tag names begin with a space), ``deepseekv31_detector.py`` (``<｜tool▁calls▁begin｜>``) and
  ``deepseekv3_detector.py`` (``function<｜tool▁sep｜>NAME`` and a ```` ```json ```` block): ``detect_and_parse`` returns the text before the block (stripped) as
  normal text and one call per invoke; parameters with ``string="true"`` stay strings, others are
  JSON-decoded; arguments are re-serialised with ``json.dumps(..., ensure_ascii=False)``.
* ``sglang/srt/entrypoints/openai/serving_chat.py``: reasoning is split first (only with
  ``separate_reasoning``), then tool calls (only with tools given and ``tool_choice != "none"``); a
  parsed call turns ``finish_reason`` into ``"tool_calls"``; ``content`` and
  ``reasoning_content`` are null when empty (``content=text if text else None``); tool call ids are ``call_<24 hex>``.

A parser name whose detector does not recognise the emitted markup leaves the raw text in ``content``,
as SGLang does.
"""

from __future__ import annotations

import json
import re
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"

_ALWAYS = {"deepseek-r1", "step3", "step3p5", "qwen3-thinking"}
_EXPLICIT_THINKING = {"deepseek-v3", "deepseek-v4", "deepseek-v41"}
_TAG_ONLY = {"qwen3", "dots", "minimax", "nanbeige"}
THINK_TAG_PARSERS = _ALWAYS | _EXPLICIT_THINKING | _TAG_ONLY


def reasoning_forced(parser: str, chat_template_kwargs: dict[str, Any] | None) -> bool:
    """``OpenAIServingChat._get_reasoning_from_request`` for the ``<think>``-token parsers."""
    if parser in _ALWAYS:
        return True
    if parser in _EXPLICIT_THINKING:
        return chat_template_kwargs is not None and chat_template_kwargs.get("thinking") is True
    return False


def split_reasoning(parser: str | None, text: str, forced: bool) -> tuple[str | None, str]:
    """``ReasoningParser.parse_non_stream``: returns (reasoning_text or None, normal_text)."""
    if not parser or parser not in THINK_TAG_PARSERS:
        return None, text
    in_reasoning = forced or THINK_START in text
    if not in_reasoning:
        return None, text
    processed = text.replace(THINK_START, "").strip()
    if THINK_END not in processed:
        return processed, ""
    reasoning, normal = processed.split(THINK_END, 1)
    return reasoning, normal.strip()


# parser -> its DSML tag names (block, invoke, parameter); deepseekv41's begin with a space
DSML_TAGS = {"deepseekv32": ("function_calls", "invoke", "parameter"),
              "deepseekv4": ("tool_calls", "invoke", "parameter"),
              "deepseekv41": (" calls", " invoke", " parameter")}
_V31_BOT = "<｜tool▁calls▁begin｜>"
_V31_CALL_RE = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
_V3_CALL_RE = re.compile(r"<｜tool▁call▁begin｜>(.*)<｜tool▁sep｜>(.*)\n```json\n(.*)\n```<｜tool▁call▁end｜>", re.DOTALL)
TOOL_PARSERS = set(DSML_TAGS) | {"deepseekv31", "deepseekv3"}


def _dsml_params(content: str, param: str) -> dict[str, Any]:
    stripped = content.strip()
    if stripped.startswith("{") and stripped.endswith("}"):
        try:
            val = json.loads(stripped)
            if isinstance(val, dict):
                return val
        except ValueError:
            pass
    params: dict[str, Any] = {}
    tag = re.escape(param)
    for name, is_str, value in re.findall(
            rf'<｜DSML｜{tag}\s+name="([^"]+)"\s+string="([^"]+)"\s*>(.*?)</｜DSML｜{tag}>', content, re.DOTALL):
        if is_str == "true":
            params[name] = value.strip()
        else:
            try:
                params[name] = json.loads(value.strip())
            except ValueError:
                params[name] = value.strip()
    return params


def parse_tool_calls(parser: str | None, text: str,
                     tools: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str]]]:
    """``FunctionCallParser.parse_non_stream``: (normal_text, [(name, arguments_json)])."""
    if not parser or not tools:
        return text, []
    names = {t.get("function", t).get("name") for t in tools}
    calls: list[tuple[str, str]] = []
    if parser in DSML_TAGS:
        block, invoke, param = DSML_TAGS[parser]
        bot = f"<｜DSML｜{block}>"
        idx = text.find(bot)
        if idx == -1:
            return text, []
        m = re.search(re.escape(bot) + r"(.*?)" + re.escape(bot.replace("<", "</", 1)), text, re.DOTALL)
        if not m:
            return text, []
        normal = text[:idx].strip()
        tag = re.escape(invoke)
        for name, content in re.findall(rf'<｜DSML｜{tag}\s+name="([^"]+)"\s*>(.*?)</｜DSML｜{tag}>', m.group(1),
                                        re.DOTALL):
            if name in names:
                calls.append((name, json.dumps(_dsml_params(content, param), ensure_ascii=False)))
    elif parser == "deepseekv3":
        # deepseekv3_detector.detect_and_parse: each <｜tool▁call▁begin｜>…<｜tool▁call▁end｜>, the name after
        # <｜tool▁sep｜>, the arguments in the ```json block; one that does not parse returns the whole text
        idx = text.find(_V31_BOT)
        if idx == -1:
            return text, []
        normal = text[:idx].strip()
        for block in re.findall(r"<｜tool▁call▁begin｜>.*?<｜tool▁call▁end｜>", text, re.DOTALL):
            m3 = _V3_CALL_RE.search(block)
            try:
                name, args = m3.group(2), json.loads(m3.group(3))  # type: ignore[union-attr]
            except (AttributeError, ValueError):
                return text, []
            if name in names:
                calls.append((name, json.dumps(args, ensure_ascii=False)))
    elif parser == "deepseekv31":
        idx = text.find(_V31_BOT)
        if idx == -1:
            return text, []
        normal = text[:idx].strip()
        for name, args in _V31_CALL_RE.findall(text):
            name = name.strip()
            if name in names:
                try:
                    calls.append((name, json.dumps(json.loads(args), ensure_ascii=False)))
                except ValueError:
                    continue
    else:
        return text, []
    if not calls:
        return text, []
    return normal, calls
