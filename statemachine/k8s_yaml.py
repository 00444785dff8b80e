"""A small, deterministic YAML writer for pdctl's Kubernetes exports (no dependency).

It writes the subset the manifests need: mappings (in insertion order), sequences, text, integers, booleans and null,
two spaces an indent, one spelling for one value, so that the same objects always give the same bytes and a diff of
two exports shows only what changed. Text is written plain where YAML 1.1 and 1.2 both read it back as that same text
(no ``yes``/``no``/``on``/``off``, nothing that reads as a number or null), multi-line text as a literal block
(``|``), anything else double-quoted with YAML's escapes (``\\"``, ``\\\\``, ``\\n``, ``\\t``, ``\\xNN``, ``\\uNNNN``,
``\\UNNNNNNNN``: every character outside printable ASCII is escaped). ``yaml.safe_load`` reads the output back to the
very objects written (the tests check it on every export).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["dump"]

_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*")
"""Text that stays plain: letters first (no digit, so no number), then letters, digits, ``_ . / -``."""
_BOOLISH = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"})
_BLOCK_LINE = re.compile(r"[ -~]*")
"""A literal block's line: printable ASCII only (no tab, which YAML forbids in indentation)."""


def _quoted(s: str) -> str:
    out = ['"']
    for ch in s:
        o = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif 0x20 <= o < 0x7F:
            out.append(ch)
        elif o < 0x100:
            out.append(f"\\x{o:02x}")
        elif o < 0x10000:
            out.append(f"\\u{o:04x}")
        else:
            out.append(f"\\U{o:08x}")
    out.append('"')
    return "".join(out)


def _text(s: str) -> str:
    if _PLAIN.fullmatch(s) and s.lower() not in _BOOLISH:
        return s
    return _quoted(s)


def _scalar(v: Any) -> str:
    if v is True:
        return "true"
    if v is False:
        return "false"
    if v is None:
        return "null"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return _text(v)
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as YAML here")


def _block(s: str) -> bool:
    """Whether *s* is written as a literal block: several lines of printable ASCII, none ending in a space, the
    first not starting with one (a block's indentation is read from its first line), ending in at most one newline."""
    body = s[:-1] if s.endswith("\n") else s
    lines = body.split("\n")
    return ("\n" in body and not body.endswith("\n") and not lines[0].startswith(" ")
            and all(_BLOCK_LINE.fullmatch(x) and not x.endswith(" ") for x in lines))


def _value(v: Any, indent: int) -> list[str]:
    """Lines for *v* as the value after ``key:`` (or ``-``): ``[" scalar"]`` on the same line, else its lines."""
    pad = " " * indent
    if isinstance(v, dict):
        return [" {}"] if not v else ["", *_mapping(v, indent)]
    if isinstance(v, (list, tuple)):
        return [" []"] if not v else ["", *_sequence(v, indent)]
    if isinstance(v, str) and _block(v):
        head = " |" if v.endswith("\n") else " |-"
        return [head, *(f"{pad}{line}" if line else "" for line in v.rstrip("\n").split("\n"))]
    return [f" {_scalar(v)}"]


def _mapping(d: dict, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    for k, v in d.items():
        if not isinstance(k, str):
            raise TypeError(f"mapping keys are text here, not {k!r}")
        first, *rest = _value(v, indent + 2)
        out.append(f"{pad}{_text(k)}:{first}")
        out += rest
    return out


def _sequence(items: list | tuple, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    for v in items:
        if isinstance(v, dict) and v:
            lines = _mapping(v, indent + 2)
            out.append(f"{pad}- {lines[0][indent + 2:]}")
            out += lines[1:]
        elif isinstance(v, (list, tuple)) and v:
            lines = _sequence(v, indent + 2)
            out.append(f"{pad}- {lines[0][indent + 2:]}")
            out += lines[1:]
        else:
            first, *rest = _value(v, indent + 2)
            out.append(f"{pad}-{first}")
            out += rest
    return out


def dump(obj: dict, *, header: str | None = None) -> str:
    """*obj* (a mapping) as one YAML document, after *header* (comment lines, each given without its ``#``)."""
    lines = [f"# {h}" if h else "#" for h in (header.splitlines() if header else [])]
    lines += _mapping(obj, 0)
    return "\n".join(lines) + "\n"
