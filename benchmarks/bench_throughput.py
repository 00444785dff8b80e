"""Throughput of a deployment through its router: a bounded concurrency sweep driven by AIPerf.

Usage (pdctl's venv; the deployment up, or ``--apply`` to bring it up first)::

    .venv/bin/python benchmarks/bench_throughput.py examples/demo.toml [--concurrency 1,4,16] [--isl 256] \\
        [--osl 128] [--requests-per-level 8] [--state-dir DIR] [--tokenizer PATH] [--apply]

For each concurrency level it streams chat completions (``/v1/chat/completions``) of ``--isl`` prompt tokens asking
``--osl`` output tokens through the router, and reports output tok/s, requests/s, TTFT and ITL percentiles, request
latency and errors. Everything is saved under ``<state dir>/bench/<UTC time>/``: ``results.json`` (the figures with
the deployment's plan id and the versions: pdctl, AIPerf, the spec's SGLang, smg), ``table.txt``, ``throughput.png``
and AIPerf's own artifacts; the table and a terminal plot are printed.

The load generator is AIPerf (``aiperf``, NVIDIA, Apache-2.0), pinned in ``benchmarks/requirements-bench.txt`` and
installed on first use into ``.venv-bench/`` beside ``.venv``: it pins rich ~= 14.1 and textual ~= 5.3, which pdctl's
console (textual >= 8) cannot share a venv with, so it is neither a dependency nor an extra of pdctl. Why AIPerf:
made for LLM serving, maintained (0.13.0, 2026-09), OpenAI chat/completions endpoints with streaming TTFT/ITL,
concurrency sweeps in one run, JSON/CSV exports; genai-bench (sgl-project, MIT) needs Oracle's OCI SDK, locust and
gevent and Python < 3.13; guidellm (Apache-2.0) requires torch. All three need a tokenizer: against pdctl's
SGLang stand-in (``engine.launcher = "sim"``) this script builds a local word-level one splitting text as the
stand-in counts tokens (no download); for a real deployment give ``--tokenizer`` (the model's directory), and token
counts are the server's (``usage``) either way.

**Against the demo this measures pdctl's SGLang stand-in** (``python -m pdctl.sim``: no model, no GPU; it answers
at once with made-up text) behind the real smg router on one 2-core machine: the figures are the HTTP path's
(stand-in, router, client) and say nothing of SGLang's or a GPU's throughput. The results and the table say so.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import textwrap
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
BENCH_VENV = ROOT / ".venv-bench"
REQUIREMENTS = ROOT / "benchmarks" / "requirements-bench.txt"

from pdctl.statemachine.journal import Journal, default_state_dir  # noqa: E402
from pdctl.statemachine.spec import load_spec  # noqa: E402
from pdctl.statemachine.topology import dial_host  # noqa: E402

STAND_IN = ("pdctl's SGLang stand-in (engine.launcher = \"sim\": no model, no GPU) behind the real smg router: these "
            "figures measure the stand-in's and the router's HTTP path on this machine, not SGLang or a GPU")

# A word-level tokenizer that splits text as the stand-in counts tokens (sim/model.py _TOKEN_RE, without its
# special-token cases): words, single punctuation, whitespace runs. Its vocabulary is AIPerf's own prompt corpus.
_TOKENIZER = textwrap.dedent('''
    import json, re, string, sys
    from pathlib import Path
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    import aiperf
    corpus = (Path(aiperf.__file__).parent / "dataset/generator/assets/shakespeare.txt").read_text()
    pat = r"\\w+|[^\\w\\s]|\\s+"
    pieces = sorted(set(re.findall(pat, corpus)) | set(string.punctuation))
    vocab = {"[UNK]": 0, **{p: i + 1 for i, p in enumerate(pieces)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pat), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "unk_token": "[UNK]", "model_max_length": 1048576}))
''')

_PLOT = textwrap.dedent('''
    import json, sys
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = json.load(open(sys.argv[1]))
    rows = res["levels"]
    c = [r["concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(c, [r["output_tok_s"] for r in rows], "o-", label="output tok/s")
    a.set_xscale("log", base=2); a.set_xlabel("concurrency"); a.set_ylabel("output tok/s"); a.grid(True, alpha=.3)
    a2 = a.twinx(); a2.plot(c, [r["requests_s"] for r in rows], "s--", color="tab:orange", label="requests/s")
    a2.set_ylabel("requests/s")
    for key, style in (("ttft_ms_p50", "o-"), ("ttft_ms_p99", "o:"), ("itl_ms_p50", "s-"), ("itl_ms_p99", "s:")):
        b.plot(c, [r[key] for r in rows], style, label=key.replace("_ms_", " ms "))
    b.set_xscale("log", base=2); b.set_xlabel("concurrency"); b.set_ylabel("ms"); b.legend(); b.grid(True, alpha=.3)
    fig.suptitle(res["title"], fontsize=9)
    fig.tight_layout(); fig.savefig(sys.argv[2], dpi=110)
''')


def _ensure_bench_venv() -> Path:
    """``.venv-bench`` with the pinned AIPerf (created on first use: about a minute from PyPI)."""
    py = BENCH_VENV / "bin" / "python"
    want = next(line for line in REQUIREMENTS.read_text().splitlines() if line.startswith("aiperf=="))
    marker = BENCH_VENV / ".installed"
    if py.exists() and marker.exists() and marker.read_text().strip() == want:
        return py
    print(f"setting up {BENCH_VENV.name} with {want} (once)…", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(BENCH_VENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r", str(REQUIREMENTS)],
                   check=True)
    marker.write_text(want + "\n")
    return py


def _versions(py: Path, dep) -> dict[str, str]:  # noqa: ANN001
    def pkg(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    aiperf = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('aiperf'))"],
                            capture_output=True, text=True).stdout.strip()
    return {"pdctl": pkg("pdctl"), "aiperf": aiperf, "sglang (spec)": dep.sglang_version,
            "engine": "pdctl.sim stand-in" if dep.engine.launcher == "sim" else "sglang",
            "smg": pkg("smg") if dep.router_impl == "smg" else dep.router_impl, "python": sys.version.split()[0]}


def _summary(path: Path, concurrency: int) -> dict:
    d = json.loads(path.read_text())

    def pct(metric: str, p: str) -> float | None:
        return (d.get(metric) or {}).get(p)

    errors = d.get("error_request_count") or {}
    return {
        "concurrency": concurrency,
        "requests": int((d.get("request_count") or {}).get("avg") or 0),
        "errors": int(errors.get("avg") or 0) if isinstance(errors, dict) else int(errors or 0),
        "output_tok_s": (d.get("output_token_throughput") or {}).get("avg"),
        "requests_s": (d.get("request_throughput") or {}).get("avg"),
        "ttft_ms_p50": pct("time_to_first_token", "p50"), "ttft_ms_p90": pct("time_to_first_token", "p90"),
        "ttft_ms_p99": pct("time_to_first_token", "p99"),
        "itl_ms_p50": pct("inter_token_latency", "p50"), "itl_ms_p90": pct("inter_token_latency", "p90"),
        "itl_ms_p99": pct("inter_token_latency", "p99"),
        "latency_ms_p50": pct("request_latency", "p50"), "latency_ms_p99": pct("request_latency", "p99"),
        "osl_mean": (d.get("output_sequence_length") or {}).get("avg"),
        "duration_s": (d.get("benchmark_duration") or {}).get("avg"),
    }


def _table(rows: list[dict]) -> str:
    head = (f"{'conc':>4} {'reqs':>5} {'err':>3} {'out tok/s':>10} {'req/s':>7} {'TTFT p50':>9} {'p90':>7} {'p99':>7} "
            f"{'ITL p50':>8} {'p90':>7} {'p99':>7} {'lat p50':>8} {'p99':>7}")
    lines = [head, "-" * len(head)]
    f = lambda v, w, p=1: f"{v:>{w}.{p}f}" if isinstance(v, (int, float)) else f"{'?':>{w}}"  # noqa: E731
    for r in rows:
        lines.append(f"{r['concurrency']:>4} {r['requests']:>5} {r['errors']:>3} {f(r['output_tok_s'], 10)} "
                     f"{f(r['requests_s'], 7)} {f(r['ttft_ms_p50'], 9, 2)} {f(r['ttft_ms_p90'], 7, 2)} "
                     f"{f(r['ttft_ms_p99'], 7, 2)} {f(r['itl_ms_p50'], 8, 3)} {f(r['itl_ms_p90'], 7, 3)} "
                     f"{f(r['itl_ms_p99'], 7, 3)} {f(r['latency_ms_p50'], 8, 2)} {f(r['latency_ms_p99'], 7, 2)}")
    lines.append("(TTFT, ITL and latency in ms; tok/s and req/s over each level's run)")
    return "\n".join(lines)


def _terminal_plot(rows: list[dict], width: int = 50) -> str:
    top = max((r["output_tok_s"] or 0) for r in rows) or 1
    lines = ["output tok/s by concurrency"]
    for r in rows:
        v = r["output_tok_s"] or 0
        lines.append(f"  c={r['concurrency']:<4} {'█' * max(1, round(v / top * width))} {v:,.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated levels (default 1,4,16)")
    ap.add_argument("--isl", type=int, default=256, help="prompt tokens per request (default 256)")
    ap.add_argument("--osl", type=int, default=128, help="output tokens asked per request (default 128)")
    ap.add_argument("--requests-per-level", type=int, default=8, metavar="K",
                    help="requests per level = max(K × concurrency, 32) (default 8)")
    ap.add_argument("--state-dir", help="the deployment's state directory (default: pdctl's)")
    ap.add_argument("--tokenizer", help="tokenizer for prompt synthesis (default: a local one for the stand-in)")
    ap.add_argument("--apply", action="store_true", help="run `pdctl apply SPEC` first")
    ap.add_argument("--timeout", type=float, default=600, help="seconds for the whole sweep (default 600)")
    a = ap.parse_args(argv)

    dep = load_spec(a.spec)
    if dep.router is None:
        print("error: the spec has no router: the benchmark drives the deployment through it", file=sys.stderr)
        return 1
    levels = sorted({int(x) for x in a.concurrency.split(",") if x.strip()})
    if not levels or min(levels) < 1:
        print("error: --concurrency takes positive whole numbers, e.g. 1,4,16", file=sys.stderr)
        return 64
    state_dir = Path(default_state_dir(dep.name, dep.service_manager, override=a.state_dir))
    if a.apply:
        pdctl = Path(sys.executable).parent / "pdctl"
        cmd = [str(pdctl), "apply", a.spec] + (["--state-dir", a.state_dir] if a.state_dir else [])
        if subprocess.run(cmd).returncode != 0:
            return 1
    url = f"http://{dial_host(dep.router.host)}:{dep.router.port}"
    try:
        ready = httpx.get(f"{url}/readiness", timeout=5).status_code == 200
    except httpx.HTTPError:
        ready = False
    if not ready:
        print(f"error: the router at {url} is not ready: bring the deployment up first (`pdctl apply {a.spec}`, or "
              "--apply)", file=sys.stderr)
        return 1
    journal = Journal(state_dir, dep.name).read()
    model = dep.model.served_name or dep.model.path
    stand_in = dep.engine.launcher == "sim"

    py = _ensure_bench_venv()
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = state_dir / "bench" / stamp
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = a.tokenizer
    if tokenizer is None and stand_in:
        tokenizer = str(out / "tokenizer")
        subprocess.run([str(py), "-c", _TOKENIZER, tokenizer], check=True, capture_output=True)
    elif tokenizer is None:
        tokenizer = dep.model.path
    base = [str(BENCH_VENV / "bin" / "aiperf"), "profile", "--model", model, "--url", url, "--endpoint-type", "chat",
            "--streaming", "--tokenizer", tokenizer, "--isl", str(a.isl), "--osl", str(a.osl),
            "--use-server-token-count", "--random-seed", "42", "--ui", "none", "--no-auto-plot",
            "--server-metrics-formats", "json"]
    t0 = time.monotonic()
    rows = []
    log = []
    for c in levels:  # (one run a level: AIPerf sweeps lists of counts as a grid, not pairwise)
        art = out / "aiperf" / f"concurrency_{c}"
        left = a.timeout - (time.monotonic() - t0)
        run = subprocess.run([*base, "--concurrency", str(c), "--request-count", str(max(a.requests_per_level * c, 32)),
                              "--artifact-dir", str(art)], capture_output=True, text=True, timeout=max(left, 1))
        log.append(f"=== concurrency {c}: exit {run.returncode}\n{run.stdout}{run.stderr}")
        (out / "aiperf.log").write_text("\n".join(log))
        found = sorted(art.glob("**/profile_export_aiperf.json"))
        if run.returncode != 0 or not found:
            print(f"error: aiperf exited {run.returncode} at concurrency {c}; its output is in {out / 'aiperf.log'}\n"
                  + (run.stdout + run.stderr)[-2000:], file=sys.stderr)
            return 1
        rows.append(_summary(found[0], c))
    versions = _versions(py, dep)
    title = (f"{dep.name}: {model} via {url}, ISL {a.isl} / OSL {a.osl}"
             + (" — the SGLang stand-in, not SGLang" if stand_in else ""))
    result = {"deployment": dep.name, "spec": str(Path(a.spec).resolve()), "plan_id": journal.plan_id,
              "router": url, "model": model, "isl": a.isl, "osl": a.osl, "when": stamp, "versions": versions,
              "engine": STAND_IN if stand_in else "SGLang", "wall_s": round(time.monotonic() - t0, 1),
              "title": title, "levels": rows}
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    table = _table(rows)
    header = [title, f"plan {journal.plan_id}; " + ", ".join(f"{k} {v}" for k, v in versions.items())]
    if stand_in:
        header.append(f"NOTE: {STAND_IN}")
    (out / "table.txt").write_text("\n".join(header) + "\n\n" + table + "\n")
    png = out / "throughput.png"
    plotted = subprocess.run([str(py), "-c", _PLOT, str(out / "results.json"), str(png)], capture_output=True, text=True)
    print("\n".join(header))
    print()
    print(table)
    print()
    print(_terminal_plot(rows))
    print()
    print(f"saved: {out} (results.json, table.txt{', throughput.png' if plotted.returncode == 0 else ''}, aiperf/)")
    if plotted.returncode != 0:
        print(f"note: the PNG could not be drawn: {plotted.stderr.strip()[-300:]}", file=sys.stderr)
    return 0 if all(r["errors"] == 0 for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
