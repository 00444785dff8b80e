"""Throughput math: Prometheus text → frozen scrapes → rates, percentiles and sparklines.

Pure: no I/O, no Textual. :func:`parse_scrape` reads exposition text with prometheus-client's own
parser; :class:`ThroughputTracker` keeps a short history of scrapes per source and turns it into
one :class:`ThroughputSample` per source per tick.

Percentiles are computed the way Prometheus's ``histogram_quantile`` does, from **merged bucket
counts**: the cumulative buckets of every label set (TP ranks, streaming or not, several decode
servers) are added bucket by bucket, the older scrape's counts are subtracted to get the window,
and the quantile is interpolated inside the bucket that holds it. Percentiles are never averaged
(the mean of two p99s is not a p99 of anything).

Rates are counter deltas over wall time between two scrapes (a counter that went down was reset:
the new value is the increase). A source that fails to answer is ``down``; one whose last good
scrape is older than three intervals is ``stale``; either keeps its last numbers, marked as such.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Histogram",
    "Scrape",
    "ThroughputSample",
    "ThroughputTracker",
    "WANTED_METRICS",
    "counter_rate",
    "filter_exposition",
    "parse_scrape",
    "quantile",
    "sparkline",
]

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts ``(upper bound, count ≤ bound)`` sorted by bound (``+Inf`` last),
    with the observations' sum and count."""

    buckets: tuple[tuple[float, float], ...]
    sum: float = 0.0
    count: float = 0.0

    def merge(self, other: Histogram) -> Histogram:
        """Bucket-wise sum. Bounds present in only one side are dropped (their cumulative count
        on the other side is unknown); Prometheus merges the same way, by ``le``."""
        if not self.buckets:
            return other
        if not other.buckets:
            return self
        o = dict(other.buckets)
        return Histogram(
            tuple((le, c + o[le]) for le, c in self.buckets if le in o),
            self.sum + other.sum,
            self.count + other.count,
        )

    def minus(self, older: Histogram) -> Histogram:
        """The observations between *older* and this one. A reset (a count went down) returns
        this histogram whole, as a reset counter's increase is its new value."""
        if not older.buckets or self.count < older.count:
            return self
        o = dict(older.buckets)
        if any(c < o.get(le, 0.0) for le, c in self.buckets):
            return self
        return Histogram(tuple((le, c - o.get(le, 0.0)) for le, c in self.buckets), self.sum - older.sum, self.count - older.count)


def first_bound(h: Histogram | None) -> float | None:
    """The first bucket's upper bound: a quantile at or below it only says "no more than this" (interpolating from 0
    inside it, as ``histogram_quantile`` does, reads 50/90/99 ms for any TTFT under SGLang's first 100 ms bound)."""
    if h is None:
        return None
    return next((le for le, _c in h.buckets if not math.isinf(le)), None)


def quantile(q: float, h: Histogram | None) -> float | None:
    """The *q*-quantile (0..1) of *h* as Prometheus's ``histogram_quantile`` estimates it:
    linear interpolation inside the bucket holding rank ``q × count`` (the first bucket starts
    at 0); a rank in the ``+Inf`` bucket answers the highest finite bound. None when empty."""
    if h is None or not h.buckets:
        return None
    total = h.buckets[-1][1] if math.isinf(h.buckets[-1][0]) else h.count
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in h.buckets:
        if c >= rank and c > prev_c:
            if math.isinf(le):
                return prev_le
            if le <= 0:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        if not math.isinf(le):
            prev_le = le
        prev_c = c
    return prev_le


@dataclass(frozen=True)
class Scrape:
    """One parsed ``/metrics`` answer at ``at`` (epoch seconds).

    ``samples``: sample name (``sglang:prompt_tokens_total``) → ``((labels, value), …)`` for
    counters, gauges and untyped metrics; ``histograms``: family name → the histogram merged over
    every label set."""

    at: float
    samples: Mapping[str, tuple[tuple[Labels, float], ...]] = field(default_factory=dict)
    histograms: Mapping[str, Histogram] = field(default_factory=dict)

    def total(self, name: str, **where: str) -> float | None:
        """Sum of *name* over label sets matching *where* (``status_code="500"``); None when absent."""
        rows = self.samples.get(name)
        if rows is None:
            return None
        if not where:
            return sum(v for _l, v in rows)
        return sum(v for labels, v in rows if all(dict(labels).get(k) == want for k, want in where.items()))

    def total_where(self, name: str, pred) -> float | None:  # noqa: ANN001
        """Sum of *name* over label sets (as a dict) that satisfy *pred*."""
        rows = self.samples.get(name)
        if rows is None:
            return None
        return sum(v for labels, v in rows if pred(dict(labels)))

    def has(self, name: str) -> bool:
        return name in self.samples or name in self.histograms


WANTED_METRICS = frozenset(
    {
        # SGLang server (scheduler and tokenizer collectors)
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:kv_used_tokens",
        "sglang:num_used_tokens",
        "sglang:max_total_num_tokens",
        "sglang:num_transfer_failed_reqs_total",
        "sglang:time_to_first_token_seconds",
        "sglang:inter_token_latency_seconds",
        "sglang:kv_transfer_latency_ms",
        # smg router (prometheus port)
        "smg_router_requests_total",
        "smg_http_responses_total",
        "smg_worker_health",
        "smg_worker_requests_active",
    }
)
"""The metric families the throughput panel reads (:func:`filter_exposition` keeps only these)."""

_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count", "_created")


@functools.lru_cache(maxsize=8)
def _sample_names(names: frozenset[str]) -> frozenset[str]:
    """Every sample (and TYPE/HELP) name the families *names* can expose."""
    keep: set[str] = set()
    for n in names:
        base = n.removesuffix("_total")
        keep.update(base + sfx for sfx in _SUFFIXES)
    return frozenset(keep)


def filter_exposition(text: str, names: frozenset[str] = WANTED_METRICS) -> str:
    """Only the lines of *text* (samples and their ``# TYPE``/``# HELP``) that belong to the
    families *names*. A router's exposition is ~40 kB of which the panel reads a few lines;
    dropping the rest before parsing cuts the console's CPU use several-fold."""
    keep = _sample_names(names)
    out = []
    for line in text.splitlines():
        if not line:
            continue
        if line[0] == "#":
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("TYPE", "HELP") and parts[2] in keep:
                out.append(line)
            continue
        i = 0
        n = len(line)
        while i < n and line[i] not in "{ ":
            i += 1
        if line[:i] in keep:
            out.append(line)
    return "\n".join(out) + "\n"


def parse_scrape(text: str, at: float, *, only: frozenset[str] | None = WANTED_METRICS) -> Scrape:
    """Parse Prometheus text exposition with prometheus-client's parser, keeping only the
    families *only* (None: all). Raises ValueError on text the parser rejects."""
    from prometheus_client.parser import text_string_to_metric_families

    if only is not None:
        text = filter_exposition(text, only)

    samples: dict[str, list[tuple[Labels, float]]] = {}
    hists: dict[str, Histogram] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type in ("histogram", "gaugehistogram"):
            per_set: dict[Labels, dict] = {}
            for s in fam.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                d = per_set.setdefault(labels, {"b": [], "sum": 0.0, "count": 0.0})
                if s.name.endswith("_bucket"):
                    d["b"].append((float(s.labels["le"]), float(s.value)))
                elif s.name.endswith("_sum"):
                    d["sum"] = float(s.value)
                elif s.name.endswith("_count"):
                    d["count"] = float(s.value)
            merged: Histogram | None = None
            for d in per_set.values():
                h = Histogram(tuple(sorted(d["b"])), d["sum"], d["count"])
                merged = h if merged is None else merged.merge(h)
            if merged is not None:
                hists[fam.name] = merged
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            samples.setdefault(s.name, []).append((tuple(sorted(s.labels.items())), float(s.value)))
    return Scrape(at, {k: tuple(v) for k, v in samples.items()}, hists)


def counter_rate(new: float | None, old: float | None, dt: float) -> float | None:
    """Per-second increase of a counter between two readings *dt* seconds apart. A counter that
    went down was reset: its increase is the new value. None when either is missing."""
    if new is None or old is None or dt <= 0:
        return None
    inc = new - old if new >= old else new
    return inc / dt


_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float | None], width: int, *, top: float | None = None) -> str:
    """Eight-level bars for *values* (oldest first), resampled to *width* columns by taking each
    column's maximum (a burst stays visible). Missing values are blanks; padded on the left."""
    if width <= 0:
        return ""
    vals = list(values)
    if not vals:
        return " " * width
    cols: list[float | None] = []
    if len(vals) <= width:
        cols = [None] * (width - len(vals)) + vals
    else:
        step = len(vals) / width
        for i in range(width):
            chunk = [v for v in vals[int(i * step) : max(int((i + 1) * step), int(i * step) + 1)] if v is not None]
            cols.append(max(chunk) if chunk else None)
    present = [v for v in cols if v is not None]
    hi = top if top is not None else (max(present) if present else 0.0)
    out = []
    for v in cols:
        if v is None:
            out.append(" ")
        elif hi <= 0 or v <= 0:
            out.append(_BARS[0])
        else:
            out.append(_BARS[min(len(_BARS) - 1, int(v / hi * (len(_BARS) - 1) + 0.5))])
    return "".join(out)


# --- per-source throughput -----------------------------------------------------------------------


@dataclass(frozen=True)
class ThroughputSample:
    """What the throughput panel shows for one source (a server role or the router).

    Rates are per second over the smoothing window; percentiles are seconds (KV transfer: ms)
    over the percentile window, or over the whole life of the server when the window saw no
    observation (``pct_all_time``). None: not exposed or not yet computable."""

    source: str
    kind: str
    """``prefill``, ``decode``, ``server`` or ``router``."""
    url: str
    state: str
    """``ok``, ``stale``, ``down`` or ``waiting`` (no scrape yet)."""
    error: str | None = None
    age_s: float | None = None
    """Seconds since the last good scrape."""
    input_tok_s: float | None = None
    gen_tok_s: float | None = None
    running: float | None = None
    queued: float | None = None
    kv_usage: float | None = None
    """KV pool usage 0..1 (``sglang:token_usage``)."""
    kv_used_tokens: float | None = None
    kv_total_tokens: float | None = None
    ttft_s: tuple[float | None, float | None, float | None] = (None, None, None)
    """p50, p90, p99."""
    ttft_first_bound_s: float | None = None
    """The TTFT histogram's first bucket bound (:func:`first_bound`): percentiles at or below it are "≤ this"."""
    itl_s: tuple[float | None, float | None, float | None] = (None, None, None)
    itl_first_bound_s: float | None = None
    kv_xfer_ms: tuple[float | None, float | None] = (None, None)
    """p50, p99 of ``sglang:kv_transfer_latency_ms``."""
    kv_xfer_failed: float | None = None
    """``sglang:num_transfer_failed_reqs_total`` (lifetime)."""
    kv_xfer_failed_s: float | None = None
    req_s: float | None = None
    """Router: routed requests per second (``smg_router_requests_total``)."""
    err_s: float | None = None
    """Router: server-error responses (status ≥ 500) per second (``smg_http_responses_total``), its own
    health and inventory endpoints (``/readiness``, ``/health``, ``/workers``…) left out."""
    errors: float | None = None
    """Router: server-error responses (status ≥ 500), lifetime."""
    client_errors: float | None = None
    """Router: client-error responses (400–499, including smg's 499 for a client that closed first), lifetime:
    counted apart, since a bad request or an impatient client is not the deployment failing."""
    errors_include_probes: bool = False
    """Router: its responses carry no ``path`` label (sglang-router 0.3.2: ``{status_code,error_code}`` only,
    shared/reference sglang-pd.md §2.3), so its probe answers (``/readiness`` 503 while workers start) cannot be told
    from failed requests and are counted in ``err_s``/``errors``/``client_errors``."""
    workers_healthy: float | None = None
    workers_total: float | None = None
    pct_all_time: bool = False
    history: tuple[float | None, ...] = ()
    """The headline rate (prefill input tok/s, decode gen tok/s, router req/s), oldest first."""

    @property
    def headline(self) -> float | None:
        if self.kind == "router":
            return self.req_s
        if self.kind == "prefill":
            return self.input_tok_s
        return self.gen_tok_s


def _pcts(h: Histogram | None, qs: Iterable[float]) -> tuple[float | None, ...]:
    return tuple(quantile(q, h) for q in qs)


class ThroughputTracker:
    """Scrape history per source → :class:`ThroughputSample`. Not thread-safe: one owner.

    *smooth_s*: window of the rates; *window_s*: window of the percentiles; *history_s*: how much
    headline history the sparkline keeps; *stale_after_s*: a source without a good scrape for
    that long is ``stale``."""

    def __init__(self, *, smooth_s: float = 5.0, window_s: float = 60.0, history_s: float = 300.0, stale_after_s: float = 3.0) -> None:
        self.smooth_s = smooth_s
        self.window_s = window_s
        self.history_s = history_s
        self.stale_after_s = stale_after_s
        self._scrapes: dict[str, deque[Scrape]] = {}
        self._history: dict[str, deque[tuple[float, float | None]]] = {}
        self._last: dict[str, ThroughputSample] = {}

    def _older(self, q: deque[Scrape], at: float, span: float) -> Scrape | None:
        """The newest scrape at least *span* seconds older than *at*, else the oldest (None if
        the only one is the newest)."""
        best = None
        for s in q:
            if at - s.at >= span:
                best = s
            else:
                break
        if best is None and len(q) > 1:
            best = q[0]
        return best

    def observe(self, source: str, kind: str, url: str, at: float, scrape: Scrape | None, error: str | None = None) -> ThroughputSample:
        """Record one scrape (or the *error* of a failed one) and return the source's sample."""
        q = self._scrapes.setdefault(source, deque())
        hist = self._history.setdefault(source, deque())
        if scrape is None:
            last = self._last.get(source)
            state = "down"
            base = last or ThroughputSample(source=source, kind=kind, url=url, state=state)
            age = (at - q[-1].at) if q else None
            hist.append((at, None))
            self._trim(hist, at)
            out = _replace(base, state=state, error=error or "no answer", age_s=age, history=tuple(v for _t, v in hist))
            self._last[source] = out
            return out
        q.append(scrape)
        while q and at - q[0].at > max(self.window_s, self.smooth_s) + 1.0 and len(q) > 2:
            q.popleft()
        out = self._compute(source, kind, url, q)
        hist.append((at, out.headline))
        self._trim(hist, at)
        out = _replace(out, history=tuple(v for _t, v in hist))
        self._last[source] = out
        return out

    def mark(self, source: str, at: float) -> ThroughputSample | None:
        """Re-age the last sample of *source* without a new scrape (``stale`` when too old)."""
        last = self._last.get(source)
        q = self._scrapes.get(source)
        if last is None or not q:
            return last
        age = at - q[-1].at
        state = "stale" if age > self.stale_after_s and last.state == "ok" else last.state
        return _replace(last, age_s=age, state=state)

    def _trim(self, hist: deque, at: float) -> None:
        while hist and at - hist[0][0] > self.history_s:
            hist.popleft()

    def _compute(self, source: str, kind: str, url: str, q: deque[Scrape]) -> ThroughputSample:
        new = q[-1]
        smooth = self._older(q, new.at, self.smooth_s)
        window = self._older(q, new.at, self.window_s)
        dt = (new.at - smooth.at) if smooth else 0.0

        def rate(name: str, **where: str) -> float | None:
            if smooth is None:
                return None
            return counter_rate(new.total(name, **where), smooth.total(name, **where), dt)

        def win(name: str) -> tuple[Histogram | None, bool]:
            h = new.histograms.get(name)
            if h is None:
                return None, False
            if window is not None:
                d = h.minus(window.histograms.get(name, Histogram(())))
                if d.count > 0:
                    return d, False
            return h, True

        if kind == "router":
            req = rate("smg_router_requests_total")
            err = None
            errors = new.total_where("smg_http_responses_total", _is_server_error)
            if smooth is not None and errors is not None:
                err = counter_rate(errors, smooth.total_where("smg_http_responses_total", _is_server_error), dt)
            health = new.samples.get("smg_worker_health", ())
            responses = new.samples.get("smg_http_responses_total", ())
            return ThroughputSample(
                source=source, kind=kind, url=url, state="ok", age_s=0.0,
                req_s=req, err_s=err, errors=errors,
                errors_include_probes=bool(responses) and not any("path" in dict(labels) for labels, _v in responses),
                client_errors=new.total_where("smg_http_responses_total", _is_client_error),
                running=new.total("smg_worker_requests_active"),
                workers_healthy=sum(1 for _l, v in health if v >= 1) if health else None,
                workers_total=len(health) if health else None,
            )
        ttft, a1 = win("sglang:time_to_first_token_seconds")
        itl, a2 = win("sglang:inter_token_latency_seconds")
        kvx, a3 = win("sglang:kv_transfer_latency_ms")
        failed = new.total("sglang:num_transfer_failed_reqs_total")
        return ThroughputSample(
            source=source, kind=kind, url=url, state="ok", age_s=0.0,
            input_tok_s=rate("sglang:prompt_tokens_total"),
            gen_tok_s=rate("sglang:generation_tokens_total"),
            running=new.total("sglang:num_running_reqs"),
            queued=new.total("sglang:num_queue_reqs"),
            kv_usage=_mean(new, "sglang:token_usage"),
            kv_used_tokens=new.total("sglang:kv_used_tokens") if new.has("sglang:kv_used_tokens") else new.total("sglang:num_used_tokens"),
            kv_total_tokens=new.total("sglang:max_total_num_tokens"),
            ttft_s=_pcts(ttft, (0.5, 0.9, 0.99)),  # type: ignore[arg-type]
            ttft_first_bound_s=first_bound(ttft),
            itl_s=_pcts(itl, (0.5, 0.9, 0.99)),  # type: ignore[arg-type]
            itl_first_bound_s=first_bound(itl),
            kv_xfer_ms=_pcts(kvx, (0.5, 0.99)),  # type: ignore[arg-type]
            kv_xfer_failed=failed,
            kv_xfer_failed_s=rate("sglang:num_transfer_failed_reqs_total"),
            pct_all_time=any(flag for flag, h in ((a1, ttft), (a2, itl), (a3, kvx)) if h is not None),
        )


def _status_class(code: str) -> int:
    try:
        return int(code) // 100
    except ValueError:
        return 0


_PROBE_PATHS = frozenset({"/health", "/liveness", "/readiness", "/workers", "/metrics"})
"""The router's own health and inventory endpoints (pdctl's probes and checks call them): a 503 from
``/readiness`` while workers start is the router's state, already shown, not a failed request."""


def _is_server_error(labels: dict[str, str]) -> bool:
    return _status_class(labels.get("status_code", "")) == 5 and labels.get("path") not in _PROBE_PATHS


def _is_client_error(labels: dict[str, str]) -> bool:
    return _status_class(labels.get("status_code", "")) == 4 and labels.get("path") not in _PROBE_PATHS


def _mean(s: Scrape, name: str) -> float | None:
    """Mean of a gauge over label sets (token usage is a ratio per TP/DP rank: sum is wrong)."""
    rows = s.samples.get(name)
    if not rows:
        return None
    return sum(v for _l, v in rows) / len(rows)


def _replace(s: ThroughputSample, **kw: object) -> ThroughputSample:
    from dataclasses import replace

    return replace(s, **kw)  # type: ignore[arg-type]
