"""The mission's paged-vs-contiguous claims, and the one table that sets our figures beside them.

The claims (README's mission; Llama-2-13B on one A100-80GB), contiguous then paged: longest
sequence 4K vs 32K tokens, fragmentation 37% vs 4.2%, 112 vs 394 output tokens/s, 48 GB vs 18 GB
of KV memory, TTFT 580 vs 340 ms, cost $0.0023 vs $0.0007 "per token". The cost figures only
agree with the throughput figures per *thousand* tokens (at $0.93 per machine-hour: 112 tok/s is
403K tokens/h, $0.0023 each thousand), so they are shown here as $2.30 and $0.70 per million.
The mission does not say which TTFT statistic it quotes; it is shown beside our median.

``format_table`` prints any set of run summaries (``SimulationResult.summary()`` plus
``max_seq_len`` and ``cost_per_m_tokens``; measured by ``bench compare`` or simulated by
``simulate``) in the mission's row order, with the claims as two more columns when asked.
"""

from __future__ import annotations

CLAIMED_SETUP = "Llama-2-13B, one A100-80GB"
CLAIMS = {  # key: (contiguous, paged)
    "max_seq_len": (4096, 32768),
    "mean_fragmentation": (0.37, 0.042),
    "output_tokens_per_s": (112.0, 394.0),
    "peak_kv_bytes": (48e9, 18e9),
    "ttft_p50_s": (0.580, 0.340),
    "cost_per_m_tokens": (2.30, 0.70),
}
MISSION_PRICE_PER_HOUR = 0.93  # what makes the mission's cost claims agree with its throughput claims


def cost_per_m_tokens(price_per_hour: float, tokens_per_s: float) -> float | None:
    """Dollars per million output tokens at ``price_per_hour`` per machine-hour."""
    if price_per_hour <= 0 or tokens_per_s <= 0:
        return None
    return price_per_hour / 3600 / tokens_per_s * 1e6


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ms(v) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def _num(v) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if isinstance(v, int) or abs(v) >= 100 else f"{v:.3g}"


def _bytes(v) -> str:
    if v is None:
        return "-"
    return f"{v / 1e9:.1f} GB" if v >= 1e9 else f"{v / 1e6:.0f} MB"  # decimal, as the claims are stated


def _money(v) -> str:
    return "-" if v is None else f"${v:.3g}"


ROWS = [  # label, keys, format
    ("longest sequence that fits (tokens)", ("max_seq_len",), _num),
    ("fragmentation mean / max", ("mean_fragmentation", "max_fragmentation"), _pct),
    ("output tokens/s", ("output_tokens_per_s",), _num),
    ("requests/s", ("requests_per_s",), _num),
    ("cost per M output tokens", ("cost_per_m_tokens",), _money),
    ("peak KV memory", ("peak_kv_bytes",), _bytes),
    ("KV blocks per GiB", ("blocks_per_gib",), _num),
    ("TTFT p50 / p99 (ms)", ("ttft_p50_s", "ttft_p99_s"), _ms),
    ("TPOT p50 / p99 (ms)", ("tpot_p50_s", "tpot_p99_s"), _ms),
    ("concurrent sequences mean / max", ("mean_batch", "max_batch"), _num),
    ("preemptions", ("preemptions",), _num),
    ("prefix-cache hit rate", ("prefix_cache_hit_rate",), _pct),
    ("finished / rejected", ("finished", "rejected"), _num),
]


def format_table(columns: dict[str, dict], claims: bool = False, markdown: bool = False) -> str:
    """One row per metric, one column per run (name -> summary), then the claimed contiguous and
    paged figures when ``claims``."""
    names = list(columns) + (["claimed contiguous", "claimed paged"] if claims else [])
    rows = []
    for label, keys, fmt in ROWS:
        cells = [" / ".join(fmt(summary.get(k)) for k in keys) for summary in columns.values()]
        if claims:
            claimed = [CLAIMS.get(k) for k in keys]
            cells += ["-" if all(c is None for c in claimed) else
                      " / ".join(fmt(c[side]) if c is not None else "-" for c in claimed) for side in (0, 1)]
        rows.append([label, *cells])
    if markdown:
        lines = ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    width = max(16, *(len(n) + 2 for n in names), *(len(c) + 2 for r in rows for c in r[1:]))
    lines = [f"{'':<34}" + "".join(f"{n:>{width}}" for n in names)]
    lines += [f"{r[0]:<34}" + "".join(f"{c:>{width}}" for c in r[1:]) for r in rows]
    return "\n".join(lines)
