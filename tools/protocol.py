"""The benchmarking protocol's arithmetic (docs/benchmarking.md), in one tested place.

Every figure a table reports goes through these functions: a worker's step times become tokens/s and MFU
(:func:`step_figures`), several invocations of one setting become a median and a min-max (:func:`spread`), a
contender's sweep becomes its best point (:func:`best_point`: out-of-memory points stay in the record, they are
never the best), and two contenders' medians become a ratio flagged where their ranges overlap (:func:`ratio`).
The minimums (3 invocations, 5 timed steps after 2 warm-up steps) are checked by :func:`check_protocol`; the order
of contenders alternates between invocations (:func:`run_order`).

MFU convention: model FLOPs per token = 6 x non-embedding parameters + 12 L h s (attention over the whole sequence,
not halved for causality; PaLM appendix B), over the whole step, optimizer included; ``mfu_no_attention`` counts
6 N alone. ``tests/test_protocol.py`` pins every formula with figures worked out by hand.
"""

from __future__ import annotations

import statistics
from typing import Hashable, Iterable, Mapping, Optional, Sequence

MIN_INVOCATIONS = 3
MIN_TIMED_STEPS = 5
MIN_WARMUP_STEPS = 2


def check_protocol(*, invocations: int, steps: int, warmup: int) -> None:
    """ValueError naming the setting below the protocol's minimum (a quick look passes ``--quick`` instead, and
    its record says ``protocol: false``)."""
    low = [f"{name}={value} (at least {least})" for name, value, least in
           (("invocations", invocations, MIN_INVOCATIONS), ("steps", steps, MIN_TIMED_STEPS),
            ("warmup", warmup, MIN_WARMUP_STEPS)) if value < least]
    if low:
        raise ValueError(f"below the benchmarking protocol: {', '.join(low)}; raise them, or pass --quick for a "
                         "look whose record is marked protocol: false")


def train_flops_per_token(non_embedding_params: float, num_layers: int, attention_width: int, seq_len: int, *,
                          attention: bool = True) -> float:
    """6 N + 12 L h s (``attention=False``: 6 N alone). The adapters' ``flops_per_token`` is this formula."""
    return 6.0 * non_embedding_params + (12.0 * num_layers * attention_width * seq_len if attention else 0.0)


def step_figures(fb_times: Sequence[float], opt_times: Sequence[float], losses: Sequence[float], *, tokens: int,
                 flops_per_token: float, peak_tflops: float, attention_flops_per_token: float = 0.0,
                 recomputed: float = 1.0, host_peak_rss_gib: float = 0.0) -> dict:
    """One invocation's figures from its timed steps: the median forward+backward and optimizer seconds, tokens/s
    over the whole step (optimizer included) and over forward+backward alone, MFU (``flops_per_token``: 6 N +
    12 L h s) and ``mfu_no_attention`` (6 N), HFU adding the recomputed forward (of the fraction ``recomputed``
    of the blocks' work: 0 without recompute), and every step's time."""
    if not fb_times or len(fb_times) != len(opt_times):
        raise ValueError(f"step_figures: {len(fb_times)} forward+backward and {len(opt_times)} optimizer times")
    step_times = [a + b for a, b in zip(fb_times, opt_times)]
    fb, opt, step = statistics.median(fb_times), statistics.median(opt_times), statistics.median(step_times)
    recompute_per_token = recomputed * flops_per_token / 3  # a recomputed forward: + (2 N + 4 L h s)
    peak = peak_tflops * 1e12
    return {
        "tokens_per_step": tokens, "fwd_bwd_s": fb, "optimizer_s": opt, "step_s": step,
        "tokens_per_s_fwd_bwd": tokens / fb, "tokens_per_s": tokens / step,
        "mfu_fwd_bwd": tokens / fb * flops_per_token / peak, "mfu": tokens / step * flops_per_token / peak,
        "mfu_no_attention": tokens / step * (flops_per_token - attention_flops_per_token) / peak,
        "hfu_fwd_bwd": tokens / fb * (flops_per_token + recompute_per_token) / peak,
        "host_peak_rss_gib": host_peak_rss_gib, "losses": list(losses), "flops_per_token": flops_per_token,
        "step_times_s": step_times,
    }


def spread(values: Iterable[float]) -> dict:
    """{median, min, max, n, spread}: ``spread`` = (max - min) / median, the relative range."""
    values = sorted(values)
    if not values:
        raise ValueError("spread of no values")
    median = statistics.median(values)
    return {"median": median, "min": values[0], "max": values[-1], "n": len(values),
            "spread": (values[-1] - values[0]) / median if median else 0.0}


def ranges_overlap(a: dict, b: dict) -> bool:
    """Whether two spreads' [min, max] intersect: then the two rows show no measurable difference."""
    return a["min"] <= b["max"] and b["min"] <= a["max"]


def ratio(ours: dict, theirs: dict) -> dict:
    """``ours`` over ``theirs`` (two spreads): median over median, and whether their ranges overlap."""
    return {"ratio": ours["median"] / theirs["median"], "overlap": ranges_overlap(ours, theirs),
            "ours": ours["median"], "theirs": theirs["median"]}


def paired_ratio(ours: Mapping[Hashable, float], theirs: Mapping[Hashable, float]) -> dict:
    """:func:`ratio` of two rows given as {invocation: figure}, over the invocations both ran in: the protocol
    divides only rows of the same invocations. Where their invocations differ (one repeated again by a later
    command), both medians are over the shared ones (``invocations`` names them) if there are at least
    :data:`MIN_INVOCATIONS`; with fewer, of all their figures, flagged ``separate_invocations``: not a protocol
    figure until they run together. ``invocations`` is None where both ran in the same ones."""
    shared = sorted(set(ours) & set(theirs))
    if set(ours) == set(theirs) or len(shared) < MIN_INVOCATIONS:
        return {**ratio(spread(ours.values()), spread(theirs.values())),
                "separate_invocations": set(ours) != set(theirs),
                "invocations": None if set(ours) == set(theirs) else shared}
    return {**ratio(spread(ours[i] for i in shared), spread(theirs[i] for i in shared)),
            "separate_invocations": False, "invocations": shared}


def best_point(rows: Sequence[dict], key: str = "tokens_per_s") -> Optional[dict]:
    """The ok row with the highest ``key`` (ties: the first), or None when no point ran. Rows that ran out of
    memory, failed or were skipped never win; they stay in the record all the same."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get(key) is not None]
    return max(ok, key=lambda r: r[key]) if ok else None


def divisors(batch: int) -> list[int]:
    """Every micro-batch size n that divides ``batch`` (ascending)."""
    if batch < 1:
        raise ValueError(f"batch {batch}: must be at least 1")
    return [n for n in range(1, batch + 1) if batch % n == 0]


def run_order(items: Sequence, invocation: int) -> list:
    """The order of ``items`` in invocation ``invocation`` (0-based): as given in even ones, reversed in odd ones,
    so that no contender always runs first (cold host caches) or last (a warm, busy host)."""
    return list(items) if invocation % 2 == 0 else list(reversed(items))


def summarize(runs: Sequence[dict], key: str = "tokens_per_s") -> dict:
    """Several invocations of one setting -> its spread of ``key`` over the invocations that ran, and how many
    did not (each invocation contributes its own median step, :func:`step_figures`)."""
    ok = [r[key] for r in runs if r.get("status") == "ok" and r.get(key) is not None]
    failed = [r.get("status", "failed") for r in runs if r.get("status") != "ok"]
    out = spread(ok) if ok else {"median": None, "min": None, "max": None, "n": 0, "spread": None}
    return {**out, "not_ok": failed}
