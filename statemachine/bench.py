"""Throughput of a deployment through its router: a bounded concurrency sweep driven by AIPerf (``pdctl bench``).

For each concurrency level it streams chat completions (``/v1/chat/completions``) of ``isl`` prompt tokens asking
``osl`` output tokens through the router, and reports output tok/s, requests/s, TTFT and ITL percentiles
(p50/p90/p99), request latency and errors. :func:`run` saves everything under ``<state dir>/bench/<UTC time>/``:
``results.json`` (the figures with the deployment's plan id and the versions: pdctl, AIPerf, the spec's SGLang,
smg), ``table.txt``, ``throughput.png`` and AIPerf's own artifacts. :func:`latest` reads the newest back (the
console's throughput tab shows it; it starts no load).

**The load generator is AIPerf** (``aiperf``, NVIDIA, Apache-2.0), pinned in ``data/requirements-bench.txt`` and
installed on first use into its own venv (:func:`bench_venv`: ``.venv-bench`` beside pdctl's venv): it pins
rich ~= 14.1 and textual ~= 5.3, which pdctl's console (textual >= 8) cannot share a venv with, so it is neither a
dependency nor an extra of pdctl, and runs as a subprocess. Why AIPerf: made for LLM serving, maintained (0.13.0,
2026-09), OpenAI chat/completions endpoints with streaming TTFT/ITL, JSON/CSV exports; genai-bench (sgl-project,
MIT) needs Oracle's OCI SDK, locust and gevent and Python < 3.13; guidellm (Apache-2.0) requires torch. All three
need a tokenizer: against pdctl's SGLang stand-in (``engine.launcher = "sim"``) a local word-level one is built that
splits text as the stand-in counts tokens (no download); for a real deployment give ``tokenizer`` (the model's
directory), and token counts are the server's (``usage``) either way.

**Against the demo this measures pdctl's SGLang stand-in** (``python -m pdctl.sim``: no model, no GPU; it answers
at once with made-up text) behind the real smg router: the figures are the HTTP path's (stand-in, router, client)
and say nothing of SGLang's or a GPU's throughput. The results and the table say so.

Every wait is bounded and named through *progress* before it starts (creating the venv, PyPI, the tokenizer, each
level, the PNG). As the rest of the engine: nothing here prints, prompts or exits; errors are :class:`BenchError`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from importlib.resources import files
from pathlib import Path
from typing import Any

from pdctl.statemachine.errors import PdctlError

__all__ = ["BenchError", "BenchOptions", "BenchRefused", "BenchSetupFailed", "STAND_IN", "bench_venv",
           "ensure_bench_venv", "latest", "parse_aiperf_export", "run", "table_text", "terminal_plot"]

RESULTS_SCHEMA = 1
"""``results.json``'s ``schema``: bumped when a key changes meaning."""

VENV_TIMEOUT_S = 120.0
"""``python -m venv`` (copies pip into it; seconds on a busy 2-core machine)."""
PIP_TIMEOUT_S = 420.0
"""``pip install`` of the pinned AIPerf from PyPI (about 60 packages, ~150 MB; about a minute on a fast link)."""
PIP_SOCKET_TIMEOUT_S = 20
"""pip's own per-connection timeout: with no network it fails in seconds rather than waiting out the bound above."""
TOKENIZER_TIMEOUT_S = 90.0
"""Building the stand-in's word-level tokenizer (imports AIPerf's tokenizers)."""
PLOT_TIMEOUT_S = 90.0
"""Drawing the PNG with matplotlib from the bench venv."""
LEVEL_GRACE_S = 60.0
"""With a duration: what a level may take past it (AIPerf's start-up, the last requests' end, its exports)."""

STAND_IN = ("pdctl's SGLang stand-in (engine.launcher = \"sim\": no model, no GPU) behind the real smg router: these "
            "figures measure the stand-in's and the router's HTTP path on this machine, not SGLang or a GPU")


class BenchError(PdctlError):
    """The benchmark could not run or finish (AIPerf failed, a level ran past its bound)."""

    title = "Benchmark failed"


class BenchRefused(BenchError):
    """The deployment is not up (not deployed, a role or the router not healthy), or has no router."""

    title = "Benchmark refused"


class BenchSetupFailed(BenchError):
    """The bench venv with AIPerf could not be created (no network to PyPI, a timeout, pip failed)."""

    title = "Benchmark set-up failed"


@dataclass(frozen=True)
class BenchOptions:
    """What to send. ``levels``: concurrency levels, one AIPerf run each; per level ``max(requests_per_level ×
    concurrency, 32)`` requests, or with ``duration_s`` as many as fit in that many seconds; ``timeout_s``: the whole
    sweep's bound."""

    levels: tuple[int, ...] = (1, 4, 16)
    isl: int = 256
    osl: int = 128
    requests_per_level: int = 8
    duration_s: float | None = None
    tokenizer: str | None = None
    timeout_s: float = 600.0

    def requests_at(self, concurrency: int) -> int:
        return max(self.requests_per_level * concurrency, 32)


@dataclass
class BenchRun:
    """A finished sweep: ``result`` is ``results.json``'s content, ``out`` its folder, ``png`` the plot (None where
    it could not be drawn: ``png_error`` says why)."""

    result: dict[str, Any]
    out: Path
    png: Path | None
    png_error: str | None = None
    header: list[str] = field(default_factory=list)


Progress = Callable[[str], None]


def _run_bounded(argv: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True)`` in its own session, whose whole process group (AIPerf
    starts worker processes) is killed when *timeout* passes or the caller is interrupted (Ctrl-C, SIGTERM)."""
    import signal

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.communicate(timeout=10)
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _requirements() -> str:
    return files("pdctl.statemachine").joinpath("data/requirements-bench.txt").read_text()


def aiperf_pin() -> str:
    """The pinned requirement, ``aiperf==X.Y.Z``."""
    return next(line.strip() for line in _requirements().splitlines() if line.strip().startswith("aiperf=="))


def bench_venv() -> Path:
    """Where AIPerf's venv lives: ``PDCTL_BENCH_VENV``; else ``.venv-bench`` beside the venv pdctl runs from (a
    checkout's ``.venv`` → ``.venv-bench``); else, outside any venv, ``~/.local/share/pdctl/venv-bench``."""
    if os.environ.get("PDCTL_BENCH_VENV"):
        return Path(os.environ["PDCTL_BENCH_VENV"]).expanduser()
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix).parent / ".venv-bench"
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "pdctl" / "venv-bench"


def bench_venv_ready(where: Path | None = None) -> bool:
    """Whether *where* (:func:`bench_venv`) has the pinned AIPerf installed (its marker file says so)."""
    where = where or bench_venv()
    marker = where / ".installed"
    return (where / "bin" / "aiperf").exists() and marker.exists() and marker.read_text().strip() == aiperf_pin()


def _setup_hint(where: Path, pin: str) -> str:
    return (f"where PyPI is reachable run `python3 -m venv {where} && {where}/bin/pip install '{pin}'` (or "
            "PIP_INDEX_URL=<a mirror> with pdctl bench again), or point PDCTL_BENCH_VENV at a venv that has it")


def ensure_bench_venv(where: Path | None = None, *, progress: Progress | None = None) -> Path:
    """The bench venv's python, creating the venv and installing the pinned AIPerf on first use (a file lock keeps
    two first uses from installing at once). Raises :class:`BenchSetupFailed` naming the fix."""
    import fcntl

    where = where or bench_venv()
    say = progress or (lambda _m: None)
    py = where / "bin" / "python"
    if bench_venv_ready(where):
        return py
    pin = aiperf_pin()
    where.parent.mkdir(parents=True, exist_ok=True)
    with open(where.parent / f".{where.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another pdctl bench to finish installing {where} (its lock; as long as its pip runs)…")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if bench_venv_ready(where):
            return py
        log = where.parent / f".{where.name}-setup.log"
        steps = [
            ([sys.executable, "-m", "venv", "--clear", str(where)], VENV_TIMEOUT_S,
             f"creating {where} for {pin} (python -m venv, once; up to {VENV_TIMEOUT_S:.0f} s)…"),
            ([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--timeout",
              str(PIP_SOCKET_TIMEOUT_S), "--retries", "1", "-r", "/dev/stdin"], PIP_TIMEOUT_S,
             f"installing {pin} into it from the package index (pip, once; waits for PyPI: about 60 packages, "
             f"~150 MB; up to {PIP_TIMEOUT_S:.0f} s)…"),
        ]
        with open(log, "w") as out:
            for argv, bound, words in steps:
                say(words)
                t0 = time.monotonic()
                try:
                    done = subprocess.run(argv, input=_requirements(), stdout=out, stderr=subprocess.STDOUT,
                                          text=True, timeout=bound)
                except subprocess.TimeoutExpired:
                    raise BenchSetupFailed(f"setting up {where} took more than {bound:.0f} s ({argv[2]} "
                                           f"{argv[3]}); its output is in {log}", hint=_setup_hint(where, pin)) from None
                except OSError as exc:
                    raise BenchSetupFailed(f"setting up {where}: {exc}", hint=_setup_hint(where, pin)) from None
                if done.returncode != 0:
                    tail = "\n".join(log.read_text().strip().splitlines()[-6:])
                    net = any(w in tail for w in ("NewConnectionError", "Temporary failure in name resolution",
                                                  "No matching distribution", "Could not find a version",
                                                  "ConnectTimeout", "Network is unreachable"))
                    raise BenchSetupFailed(
                        f"setting up {where} failed (exit {done.returncode} after {time.monotonic() - t0:.0f} s"
                        f"{': the package index could not be reached' if net else ''}); the output is in {log}:\n"
                        + textwrap.indent(tail, "    "), hint=_setup_hint(where, pin))
        (where / ".installed").write_text(pin + "\n")
    return py


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
    for ax in (a, b):
        ax.set_xscale("log", base=2); ax.set_xticks(c); ax.set_xticklabels([str(x) for x in c]); ax.minorticks_off()
    a2 = a.twinx(); a2.plot(c, [r["requests_s"] for r in rows], "s--", color="tab:orange", label="requests/s")
    a2.set_ylabel("requests/s")
    a.legend(handles=a.get_lines() + a2.get_lines(), loc="upper left")
    for key, style in (("ttft_ms_p50", "o-"), ("ttft_ms_p99", "o:"), ("itl_ms_p50", "s-"), ("itl_ms_p99", "s:")):
        b.plot(c, [r[key] for r in rows], style, label=key.replace("_ms_", " ms "))
    b.set_xlabel("concurrency"); b.set_ylabel("ms"); b.legend(); b.grid(True, alpha=.3)
    fig.suptitle(res["title"], fontsize=9)
    fig.tight_layout(); fig.savefig(sys.argv[2], dpi=110)
''')


def parse_aiperf_export(data: dict | str | Path, concurrency: int) -> dict[str, Any]:
    """One level's figures from AIPerf's ``profile_export_aiperf.json`` (its dict, text or path): times in ms as
    AIPerf reports them, throughputs over the level's run, ``None`` where AIPerf reported nothing."""
    if isinstance(data, Path):
        data = data.read_text()
    d: dict = json.loads(data) if isinstance(data, str) else data

    def stat(metric: str, key: str) -> float | None:
        v = (d.get(metric) or {}).get(key) if isinstance(d.get(metric), dict) else None
        return float(v) if isinstance(v, (int, float)) else None

    # (AIPerf writes error_request_count only when a request failed; error_summary lists each kind with its count)
    errors = d.get("error_request_count")
    n_err = stat("error_request_count", "avg") if isinstance(errors, dict) else errors
    if n_err is None:
        n_err = sum(int(e.get("count") or 0) for e in d.get("error_summary") or [] if isinstance(e, dict))
    return {
        "concurrency": concurrency,
        "requests": int(stat("request_count", "avg") or 0),
        "errors": int(n_err or 0),
        "output_tok_s": stat("output_token_throughput", "avg"),
        "requests_s": stat("request_throughput", "avg"),
        **{f"ttft_ms_{p}": stat("time_to_first_token", p) for p in ("p50", "p90", "p99")},
        **{f"itl_ms_{p}": stat("inter_token_latency", p) for p in ("p50", "p90", "p99")},
        "latency_ms_p50": stat("request_latency", "p50"), "latency_ms_p99": stat("request_latency", "p99"),
        "osl_mean": stat("output_sequence_length", "avg"),
        "duration_s": stat("benchmark_duration", "avg"),
    }


def table_text(rows: Sequence[dict]) -> str:
    """The levels as a plain-text table (``table.txt``; the CLI draws a rich one from the same rows)."""
    head = (f"{'conc':>4} {'reqs':>5} {'err':>3} {'out tok/s':>10} {'req/s':>7} {'TTFT p50':>9} {'p90':>7} {'p99':>7} "
            f"{'ITL p50':>8} {'p90':>7} {'p99':>7} {'lat p50':>8} {'p99':>7}")
    lines = [head, "-" * len(head)]

    def f(v: object, w: int, p: int = 1) -> str:
        return f"{v:>{w}.{p}f}" if isinstance(v, (int, float)) else f"{'?':>{w}}"

    for r in rows:
        lines.append(f"{r['concurrency']:>4} {r['requests']:>5} {r['errors']:>3} {f(r['output_tok_s'], 10)} "
                     f"{f(r['requests_s'], 7)} {f(r['ttft_ms_p50'], 9, 2)} {f(r['ttft_ms_p90'], 7, 2)} "
                     f"{f(r['ttft_ms_p99'], 7, 2)} {f(r['itl_ms_p50'], 8, 3)} {f(r['itl_ms_p90'], 7, 3)} "
                     f"{f(r['itl_ms_p99'], 7, 3)} {f(r['latency_ms_p50'], 8, 2)} {f(r['latency_ms_p99'], 7, 2)}")
    lines.append("(TTFT, ITL and latency in ms; tok/s and req/s over each level's run)")
    return "\n".join(lines)


def terminal_plot(rows: Sequence[dict], width: int = 50) -> str:
    """Output tok/s by concurrency as horizontal bars (plotext is no dependency of pdctl)."""
    top = max((r.get("output_tok_s") or 0) for r in rows) if rows else 0
    top = top or 1
    lines = ["output tok/s by concurrency"]
    for r in rows:
        v = r.get("output_tok_s") or 0
        lines.append(f"  c={r['concurrency']:<4} {'█' * max(1, round(v / top * width))} {v:,.0f}")
    return "\n".join(lines)


def header_lines(result: dict) -> list[str]:
    """The title, the plan id and versions, and the stand-in's note: what ``table.txt`` and the CLI print above."""
    lines = [result.get("title", ""), f"plan {result.get('plan_id')}; "
             + ", ".join(f"{k} {v}" for k, v in (result.get("versions") or {}).items())]
    if result.get("stand_in"):
        lines.append(f"NOTE: {STAND_IN}")
    return lines


def latest(state_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The newest saved ``results.json`` under *state_dir*/bench (folders are UTC stamps, so the greatest name is the
    newest), with ``dir`` set to its folder; None when there is none or it cannot be read."""
    root = Path(state_dir) / "bench"
    try:
        stamps = sorted((p for p in root.iterdir() if (p / "results.json").is_file()), key=lambda p: p.name)
    except OSError:
        return None
    for folder in reversed(stamps):
        try:
            res = json.loads((folder / "results.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(res, dict) and isinstance(res.get("levels"), list):
            return {**res, "dir": str(folder)}
    return None


def _pkg(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _versions(py: Path, dep) -> dict[str, str]:  # noqa: ANN001
    try:
        aiperf = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('aiperf'))"],
                                capture_output=True, text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        aiperf = "unknown"
    return {"pdctl": _pkg("pdctl"), "aiperf": aiperf, "sglang (spec)": dep.sglang_version,
            "engine": "pdctl.sim stand-in" if dep.engine.launcher == "sim" else "sglang",
            "smg": _pkg("smg") if dep.router_impl == "smg" else dep.router_impl, "python": sys.version.split()[0]}


def refuse_unless_up(loaded, *, status: dict | None = None) -> str:  # noqa: ANN001
    """The router's URL when the deployment is up (:func:`pdctl.statemachine.service.status` says healthy, without
    a canary: the load is the test); else :class:`BenchRefused` naming what is down and the fix."""
    from pdctl.statemachine import service

    dep = loaded.deployment
    spec = str(loaded.path)
    if dep.router is None:
        raise BenchRefused(f"deployment {dep.name!r} has no router: pdctl bench drives the load through it",
                           hint="add a [router] to the spec and `pdctl apply` it")
    st = status if status is not None else service.status(loaded, canary=False)
    if st.get("healthy"):
        return st["router"]["url"] if st.get("router") else f"http://{dep.router.host}:{dep.router.port}"
    if not st.get("deployed") and not st.get("applying"):
        down = [f"not deployed: nothing recorded in {loaded.journal.dir}"]
    else:
        down = [f"{r['name']} {r.get('state')}" + ("" if r.get("health") == 200 else
                                                   f", health {r.get('health') or 'no answer'}")
                for r in st.get("roles") or [] if not r.get("healthy")]
        rt = st.get("router") or {}
        if rt and (rt.get("state") != "active" or rt.get("readiness") != 200):
            down.append(f"router {rt.get('state')}, {rt.get('error') or 'not ready'}")
    what = "; ".join(down) if down else "status says it is not healthy"
    raise BenchRefused(f"deployment {dep.name!r} is not up ({what}): pdctl bench measures a running deployment",
                       hint=f"`pdctl apply {spec}` brings it up; `pdctl status {spec}` says what is down")


def run(loaded, opts: BenchOptions, *, progress: Progress | None = None, status: dict | None = None,  # noqa: ANN001
        bench_python: Path | None = None) -> BenchRun:
    """Refuse a deployment that is not up, then sweep *opts*' levels through its router with AIPerf and save the
    result under the state directory (``bench/<UTC stamp>/``). Raises :class:`BenchError` subclasses."""
    say = progress or (lambda _m: None)
    if not opts.levels or min(opts.levels) < 1:
        raise BenchError("concurrency levels must be positive whole numbers, e.g. 1,4,16")
    dep = loaded.deployment
    say(f"checking that {dep.name!r} is up (pdctl status, no canary)…")
    url = refuse_unless_up(loaded, status=status)
    state = loaded.journal.read()
    model = dep.model.served_name or dep.model.path
    stand_in = dep.engine.launcher == "sim"
    py = bench_python or ensure_bench_venv(progress=say)
    aiperf = py.parent / "aiperf"
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    out = Path(loaded.journal.dir) / "bench" / stamp
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    tokenizer = opts.tokenizer
    if tokenizer is None and stand_in:
        tokenizer = str(out / "tokenizer")
        say(f"building a word-level tokenizer for the stand-in (up to {TOKENIZER_TIMEOUT_S:.0f} s)…")
        try:
            made = _run_bounded([str(py), "-c", _TOKENIZER, tokenizer], TOKENIZER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise BenchError(f"building the stand-in's tokenizer took more than {TOKENIZER_TIMEOUT_S:.0f} s") from None
        if made.returncode != 0:
            raise BenchError(f"building the stand-in's tokenizer failed: {made.stderr.strip()[-600:]}")
    elif tokenizer is None:
        tokenizer = dep.model.path
    base = [str(aiperf), "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", tokenizer, "--isl", str(opts.isl), "--osl", str(opts.osl), "--use-server-token-count",
            "--random-seed", "42", "--ui", "none", "--no-auto-plot", "--server-metrics-formats", "json"]
    rows = []
    log: list[str] = []
    for c in opts.levels:  # (one run a level: AIPerf sweeps lists of counts as a grid, not pairwise)
        art = out / "aiperf" / f"concurrency_{c}"
        left = opts.timeout_s - (time.monotonic() - t0)
        if opts.duration_s:
            load = ["--benchmark-duration", f"{opts.duration_s:g}"]
            bound = min(left, opts.duration_s + LEVEL_GRACE_S)
            what = f"{opts.duration_s:g} s"
        else:
            load = ["--request-count", str(opts.requests_at(c))]
            bound = left
            what = f"{opts.requests_at(c)} requests"
        if bound <= 0:
            raise BenchError(f"the sweep ran past its bound ({opts.timeout_s:g} s) before concurrency {c}; "
                             f"what it measured is in {out}", hint="give --timeout more, or fewer levels")
        say(f"concurrency {c}: {what} of {opts.isl} → {opts.osl} tokens through {url} (AIPerf; up to {bound:.0f} s)…")
        try:
            done = _run_bounded([*base, "--concurrency", str(c), *load, "--artifact-dir", str(art)], bound)
        except subprocess.TimeoutExpired as exc:
            log.append(f"=== concurrency {c}: timed out after {bound:.0f} s\n{exc.stdout or ''}{exc.stderr or ''}")
            (out / "aiperf.log").write_text("\n".join(str(x) for x in log))
            raise BenchError(f"AIPerf at concurrency {c} ran past {bound:.0f} s; its output is in {out / 'aiperf.log'}",
                             hint="give --timeout more, or fewer requests (--requests-per-level) or --duration-s") \
                from None
        log.append(f"=== concurrency {c}: exit {done.returncode}\n{done.stdout}{done.stderr}")
        (out / "aiperf.log").write_text("\n".join(log))
        found = sorted(art.glob("**/profile_export_aiperf.json"))
        if done.returncode != 0 or not found:
            raise BenchError(f"AIPerf exited {done.returncode} at concurrency {c}; its output is in "
                             f"{out / 'aiperf.log'}:\n" + textwrap.indent((done.stdout + done.stderr)[-1500:], "    "))
        rows.append(parse_aiperf_export(found[0], c))
    versions = _versions(py, dep)
    title = (f"{dep.name}: {model} via {url}, ISL {opts.isl} / OSL {opts.osl}"
             + (" — the SGLang stand-in, not SGLang" if stand_in else ""))
    result = {"schema": RESULTS_SCHEMA, "deployment": dep.name, "spec": str(Path(loaded.path).resolve()),
              "plan_id": state.plan_id, "router": url, "model": model, "isl": opts.isl, "osl": opts.osl,
              "requests_per_level": None if opts.duration_s else opts.requests_per_level,
              "duration_s": opts.duration_s, "when": stamp, "versions": versions, "stand_in": stand_in,
              "engine": STAND_IN if stand_in else "SGLang", "wall_s": round(time.monotonic() - t0, 1),
              "title": title, "levels": rows}
    return save(result, out, py)


def save(result: dict, out: Path, py: Path | None = None) -> BenchRun:
    """Write ``results.json`` and ``table.txt`` into *out*, and ``throughput.png`` with *py*'s matplotlib (the bench
    venv's, which AIPerf brings)."""
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    header = header_lines(result)
    (out / "table.txt").write_text("\n".join(header) + "\n\n" + table_text(result["levels"]) + "\n")
    png, why = out / "throughput.png", None
    if py is None:
        return BenchRun(result, out, None, "no bench venv to draw it with", header)
    try:
        drawn = _run_bounded([str(py), "-c", _PLOT, str(out / "results.json"), str(png)], PLOT_TIMEOUT_S)
        why = None if drawn.returncode == 0 else drawn.stderr.strip()[-300:]
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = f"{exc}"
    if why is not None:
        with contextlib.suppress(OSError):
            png.unlink()
        return BenchRun(result, out, None, why, header)
    return BenchRun(result, out, png, None, header)
