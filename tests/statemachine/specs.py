"""Spec builders for tests: the examples as dicts, to mutate one rule at a time."""

from __future__ import annotations

import copy

from harness.deploy import DEMO, SEED, demo_dict, dsv32_dict, dump_toml, seed_dict

__all__ = ["DEMO", "SEED", "collapsed", "demo_dict", "dsv32_dict", "dump_toml", "seed_dict"]


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

