"""Spec builders for tests: the examples as dicts, to mutate one rule at a time."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "examples" / "seed.toml"
DEMO = ROOT / "examples" / "demo.toml"


def seed_dict() -> dict:
    return tomllib.loads(SEED.read_text())


def demo_dict() -> dict:
    return tomllib.loads(DEMO.read_text())


def collapsed(base: dict) -> dict:
    """The seed's failure: PD collapsed into one server on *:30001 with all eight GPUs."""
    d = copy.deepcopy(base)
    pre = d.pop("prefill")[0]
    d.pop("decode")
    d.pop("kv_transfer", None)
    d.pop("router", None)
    d["server"] = [
        {
            "host": pre["host"],
            "gpus": list(range(8)),
            "tp": 8,
            "http_host": "0.0.0.0",
            "port": 30001,
            "nccl_port": 30110,
        }
    ]
    return d


def dump_toml(d: dict) -> str:
    """A small TOML writer for the spec shapes (scalars, arrays, inline tables, tables, arrays of
    tables). Enough for tests; tomllib reads it back to the same dict."""
    import json as _json

    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return _json.dumps(v, ensure_ascii=False)
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{_json.dumps(str(k))} = {val(x)}" for k, x in v.items()) + "}"
        return repr(v) if isinstance(v, float) else str(v)

    def is_table_list(v):
        return isinstance(v, list) and v and all(isinstance(x, dict) for x in v)

    lines: list[str] = []
    for k, v in d.items():
        if not isinstance(v, dict) and not is_table_list(v):
            lines.append(f"{k} = {val(v)}")
    for k, v in d.items():
        if isinstance(v, dict):
            if k == "hosts":
                for hk, hv in v.items():
                    lines.append(f"[hosts.{hk}]")
                    lines += [f"{kk} = {val(x)}" for kk, x in hv.items()]
            else:
                lines.append(f"[{k}]")
                lines += [f"{kk} = {val(x)}" for kk, x in v.items()]
        elif is_table_list(v):
            for item in v:
                lines.append(f"[[{k}]]")
                lines += [f"{kk} = {val(x)}" for kk, x in item.items()]
    return "\n".join(lines) + "\n"
