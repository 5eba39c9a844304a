"""Sweep summaries: each point's figures from its ``metrics.jsonl``, a markdown table, a heatmap PNG.

A sweep directory holds one run directory per point (``0/``, ``1/``, ...) and, written by
``python -m fsdp_speedloader.app.sweep``, ``summary.json`` (every point: parameters, status, figures),
``summary.md`` (the table) and ``heatmap.png`` (tokens/s over sub_batch_size x num_sub_batches, one
panel per value of any other swept key; failed points marked with their status).

Re-render a sweep (e.g. on a machine with matplotlib) or summarise a plain Hydra multirun
(``python -m fsdp_speedloader.app.train sweep=NAME``, whose points read ``.hydra/overrides.yaml``):

    python -m fsdp_speedloader.app.sweep_report multirun/DATE/TIME

Point statuses: ``ok``; ``oom`` (nonzero exit with an out-of-memory error in its output);
``failed`` (any other nonzero exit); ``timeout``; ``not run`` (a Hydra multirun's point after the one that
failed: Hydra's basic launcher stops a multirun at its first failing point; the points it was asked for are read
from its ``multirun.yaml``). matplotlib is optional: without it the heatmap
is skipped with a message, and everything else is written.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
HEATMAP_PNG = "heatmap.png"
METRICS_FILE = "metrics.jsonl"  # fsdp_speedloader.app.logger.METRICS_FILE (not imported: no torch needed here)
ROW_KEY, COLUMN_KEY = "schedule.sub_batch_size", "schedule.num_sub_batches"
STATUSES = ("ok", "oom", "failed", "timeout", "not run")
MULTIRUN_YAML = "multirun.yaml"  # what Hydra writes in a multirun's sweep directory: its config and command line
HYDRA_JOB_LOG = "train.log"  # Hydra's log of a point (<job name>.log): the entry point writes a user error there
# What PyTorch's allocators (and the CUDA runtime and cuBLAS below them) print when memory runs out.
OOM_PATTERN = re.compile(
    r"OutOfMemoryError"  # torch.OutOfMemoryError (torch.cuda.OutOfMemoryError): the caching allocators
    r"|out of memory"  # 'CUDA out of memory. Tried to allocate', 'CUDA error: out of memory', NCCL's, HIP's, MPS's
    r"|DefaultCPUAllocator: (can't allocate memory|not enough memory)"  # the CPU allocator (new, old text)
    r"|CUBLAS_STATUS_ALLOC_FAILED",
    re.IGNORECASE)


def is_oom(text: str) -> bool:
    """Whether ``text`` (a process's output) shows an allocator out of memory: the GPU's or the host's."""
    return OOM_PATTERN.search(text) is not None


def classify(returncode: Optional[int], output: str, *, timed_out: bool = False) -> str:
    """A point's status from how its launch ended."""
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    return "oom" if is_oom(output) else "failed"


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of a run's ``metrics.jsonl`` (rank 0 writes it); [] when there is none."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line cut short by a crash
            continue
    return records


def summarize_metrics(records: Sequence[dict]) -> dict:
    """Figures of one run: medians over the steps after the first (warm-up), peaks, the last loss."""
    if not records:
        return {}
    # A restarted run may log a step twice: the last record of each step counts.
    by_step = {r["step"]: r for r in records if "step" in r}
    ordered = [by_step[s] for s in sorted(by_step)]
    steady = [r for r in ordered if r["step"] > 1] or ordered

    def median(key: str) -> Optional[float]:
        values = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        return statistics.median(values) if values else None

    def peak(key: str) -> Optional[float]:
        values = [r[key] for r in ordered if isinstance(r.get(key), (int, float))]
        return max(values) if values else None

    # The caching allocator's retries after the warm-up (a GPU run): a point at the memory cap, often slower than
    # the next smaller one (docs/benchmarking.md, the ladder rule).
    retries = [r["gpu_alloc_retries"] for r in steady if isinstance(r.get("gpu_alloc_retries"), int)]
    # A CPU run (no GPU memory figure) has no MFU worth showing: its "mfu" is against a GPU's peak (the console
    # line leaves it out too).
    on_gpu = peak("peak_gpu_mem_allocated_gib") is not None
    return {"steps": ordered[-1]["step"], "final_loss": ordered[-1].get("loss"),
            "tokens_per_s": median("tokens_per_s"), "tokens_per_s_per_device": median("tokens_per_s_per_device"),
            "mfu": median("mfu") if on_gpu else None, "step_time_s": median("step_time_s"),
            "peak_gpu_mem_allocated_gib": peak("peak_gpu_mem_allocated_gib"), "host_rss_gib": peak("host_rss_gib"),
            "gpu_alloc_retries": sum(retries) if retries else None}


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def markdown_table(points: Sequence[dict], axes: Sequence[str]) -> str:
    """One row per point: its swept values, status and figures (failed points: their error)."""
    head = ["#", *axes, "status", "tokens/s", "tokens/s/device", "MFU", "step s", "peak GPU GiB",
            "allocator retries", "host RSS GiB", "final loss"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        m = p.get("metrics") or {}
        status = p["status"] if p["status"] == "ok" else f"**{p['status']}**"
        cells = [str(p["index"]), *(str(p["params"].get(a, "")) for a in axes), status,
                 _fmt(m.get("tokens_per_s"), ",.0f"), _fmt(m.get("tokens_per_s_per_device"), ",.0f"),
                 _fmt(m.get("mfu"), ".1%"), _fmt(m.get("step_time_s"), ".3f"),
                 _fmt(m.get("peak_gpu_mem_allocated_gib"), ".2f"), _fmt(m.get("gpu_alloc_retries"), "d"),
                 _fmt(m.get("host_rss_gib"), ".2f"),
                 _fmt(m.get("final_loss"), ".4f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_markdown(summary: dict) -> str:
    points, axes = summary["points"], summary["axes"]
    counts = {s: sum(p["status"] == s for p in points) for s in STATUSES}
    done = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    out = [f"# Sweep {summary.get('group') or ''}".rstrip(), "",
           f"{len(points)} points ({done}); swept: {', '.join(axes)}.", ""]
    if summary.get("command"):
        out += ["```", " ".join(summary["command"]), "```", ""]
    out += [markdown_table(points, axes), ""]
    failed = [p for p in points if p["status"] not in ("ok", "not run")]
    if failed:
        out += ["Failed points (last lines of their output):", ""]
        for p in failed:
            code = f", exit {p['returncode']}" if p.get("returncode") is not None else ""
            out.append(f"- #{p['index']} ({p['status']}{code}): `{(p.get('error') or '').strip()[-300:]}`")
        out.append("")
    not_run = [str(p["index"]) for p in points if p["status"] == "not run"]
    if not_run:
        out += [f"Not run: #{', #'.join(not_run)} (Hydra stops a multirun at its first failing point).", ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# The heatmap
# ---------------------------------------------------------------------------------------------


def _sort_key(value: str) -> tuple:
    try:
        return (0, float(value), "")
    except ValueError:
        return (1, 0.0, value)


def heatmap_layout(points: Sequence[dict], axes: Sequence[str]) -> tuple[Optional[str], str, list[str]]:
    """(row key or None, column key, panel keys): sub_batch_size x num_sub_batches when both are swept."""
    axes = list(axes)
    if ROW_KEY in axes and COLUMN_KEY in axes:
        row, col = ROW_KEY, COLUMN_KEY
    elif len(axes) >= 2:
        row, col = axes[0], axes[1]
    else:
        row, col = None, axes[0]
    return row, col, [a for a in axes if a not in (row, col)]


def plot_heatmap(summary: dict, path: str | Path) -> Optional[Path]:
    """Writes the throughput heatmap; returns its path, or None (with a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("sweep: matplotlib is not installed, so no heatmap.png (pip install -e '.[plots]'); "
              f"the table is in {SUMMARY_MD}", file=sys.stderr, flush=True)
        return None
    points, axes = summary["points"], summary["axes"]
    row_key, col_key, panel_keys = heatmap_layout(points, axes)
    values = {a: sorted({p["params"][a] for p in points if a in p["params"]}, key=_sort_key) for a in axes}
    rows = values[row_key] if row_key else [""]
    cols = values[col_key]
    panels = list(itertools.product(*(values[k] for k in panel_keys))) or [()]
    ok = [p["metrics"]["tokens_per_s"] for p in points
          if p["status"] == "ok" and (p.get("metrics") or {}).get("tokens_per_s")]
    vmin, vmax = (min(ok), max(ok)) if ok else (0.0, 1.0)

    fig, axs = plt.subplots(1, len(panels), figsize=(1.6 + 1.5 * len(cols) * len(panels), 1.2 + 0.9 * len(rows)),
                            squeeze=False)
    image = None
    for ax, panel in zip(axs[0], panels):
        fixed = dict(zip(panel_keys, panel))
        grid = [[math.nan] * len(cols) for _ in rows]
        for p in points:
            if any(p["params"].get(k) != v for k, v in fixed.items()):
                continue
            i = rows.index(p["params"][row_key]) if row_key else 0
            j = cols.index(p["params"][col_key])
            tps = (p.get("metrics") or {}).get("tokens_per_s")
            if p["status"] == "ok" and tps:
                grid[i][j] = tps
                dark = (tps - vmin) / (vmax - vmin) < 0.5 if vmax > vmin else False  # viridis: dark at the low end
                ax.text(j, i, f"{tps:,.0f}", ha="center", va="center", fontsize=9, color="white" if dark else "black")
            else:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="0.85", hatch="//", edgecolor="0.5"))
                ax.text(j, i, p["status"].upper(), ha="center", va="center", fontsize=9, color="firebrick")
        image = ax.imshow(grid, cmap="viridis", vmin=vmin, vmax=vmax if vmax > vmin else vmin + 1, aspect="auto")
        ax.set_xticks(range(len(cols)), cols)
        ax.set_yticks(range(len(rows)), rows)
        ax.set_xlabel(col_key)
        if ax is axs[0][0]:
            ax.set_ylabel(row_key or "")
        ax.set_title(", ".join(f"{k.split('.')[-1]}={v}" for k, v in fixed.items()) or summary.get("group") or "sweep",
                     fontsize=10)
    fig.colorbar(image, ax=axs[0].tolist(), label="tokens/s (all ranks)")
    path = Path(path)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def write_report(summary: dict, sweep_dir: str | Path, *, heatmap: bool = True) -> dict:
    """Writes summary.json, summary.md and (with matplotlib, when asked) heatmap.png into ``sweep_dir``."""
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / SUMMARY_JSON).write_text(json.dumps(summary, indent=2) + "\n")
    (sweep_dir / SUMMARY_MD).write_text(render_markdown(summary))
    paths = {"json": sweep_dir / SUMMARY_JSON, "markdown": sweep_dir / SUMMARY_MD}
    if heatmap:
        png = plot_heatmap(summary, sweep_dir / HEATMAP_PNG)
        if png is not None:
            paths["heatmap"] = png
    return paths


# ---------------------------------------------------------------------------------------------
# Summaries of existing directories
# ---------------------------------------------------------------------------------------------


def planned_points(sweep_dir: str | Path) -> Optional[list[dict[str, str]]]:
    """The points a Hydra multirun was asked for, in Hydra's order, from its ``multirun.yaml``
    (``hydra.sweeper.params`` and the command line's comma lists, as ``app.sweep`` expands them); None without it."""
    path = Path(sweep_dir) / MULTIRUN_YAML
    if not path.is_file():
        return None
    import yaml  # PyYAML comes with hydra-core / omegaconf

    from fsdp_speedloader.app.sweep_points import expand_points, split_overrides, sweep_axes

    hydra = (yaml.safe_load(path.read_text()) or {}).get("hydra") or {}
    fixed, swept = split_overrides((hydra.get("overrides") or {}).get("task") or [])
    return expand_points(sweep_axes((hydra.get("sweeper") or {}).get("params") or {}, swept, fixed))


def _point_error(run_dir: Path) -> str:
    """The last ``error: ...`` line of a point's Hydra log (what the entry point printed), else ''."""
    log = run_dir / HYDRA_JOB_LOG
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return next((line[line.index("error: "):] for line in reversed(lines) if "error: " in line), "")


def summary_from_hydra_multirun(sweep_dir: str | Path) -> dict:
    """A summary of a Hydra multirun directory (points ``N/`` with ``.hydra/overrides.yaml``).

    Hydra keeps no exit status: a point counts as ``ok`` when it logged metrics, else ``oom`` or ``failed`` (from
    the error its log ends with). Points the multirun was asked for (``multirun.yaml``) that have no directory are
    ``not run``: Hydra stopped at a failing point before them. Swept keys are the override keys whose value differs
    between points.
    """
    import yaml  # PyYAML comes with hydra-core / omegaconf

    points = []
    for run_dir in sorted((p for p in Path(sweep_dir).iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        overrides_file = run_dir / ".hydra" / "overrides.yaml"
        overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
        params = dict(o.split("=", 1) for o in overrides if "=" in o)
        metrics = summarize_metrics(read_metrics(run_dir))
        error = "" if metrics else _point_error(run_dir)
        points.append({"index": int(run_dir.name), "params": params,
                       "status": "ok" if metrics else classify(1, error), "returncode": None,
                       "run_dir": str(run_dir), "metrics": metrics, "error": error})
    planned = planned_points(sweep_dir) or []
    ran = {p["index"] for p in points}
    fixed = points[0]["params"] if points else {}
    for index, swept in enumerate(planned):
        if index not in ran:
            points.append({"index": index, "params": {**fixed, **swept}, "status": "not run", "returncode": None,
                           "run_dir": None, "metrics": {}, "error": ""})
    points.sort(key=lambda p: p["index"])
    keys = list(dict.fromkeys(k for p in points for k in p["params"]))
    axes = [k for k in keys if len({p["params"].get(k) for p in points}) > 1]
    for p in points:
        p["params"] = {k: p["params"][k] for k in axes if k in p["params"]}
    return {"group": None, "axes": axes, "points": points}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_speedloader.app.sweep_report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep_dir")
    args = parser.parse_args(argv)
    sweep_dir = Path(args.sweep_dir)
    if not sweep_dir.is_dir():
        parser.error(f"{str(sweep_dir)!r} is not a directory: give a sweep directory (app.sweep's, or a Hydra "
                     "multirun's, e.g. multirun/DATE/TIME)")
    summary_file = sweep_dir / SUMMARY_JSON
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    if summary is None or summary.get("group") is None:  # app.sweep's summary, or a multirun's: read again, as
        summary = summary_from_hydra_multirun(sweep_dir)  # its points may have finished since the last report
    if not summary["points"]:
        print(f"sweep_report: no points in {sweep_dir}", file=sys.stderr)
        return 1
    if not summary["axes"]:
        print(f"sweep_report: the points of {sweep_dir} do not differ in any override", file=sys.stderr)
        return 1
    paths = write_report(summary, sweep_dir)
    print(render_markdown(summary))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    not_run = [p for p in summary["points"] if p["status"] == "not run"]
    if not_run:
        stopped = max((p for p in summary["points"] if p["status"] != "not run"), key=lambda p: p["index"])
        print(f"sweep_report: {len(not_run)} of {len(summary['points'])} points did not run: Hydra stops a multirun "
              f"at its first failing point (#{stopped['index']}, {stopped['status']}"
              f"{': ' + stopped['error'] if stopped.get('error') else ''}). `python -m fsdp_speedloader.app.sweep` "
              "with the same overrides runs every point in its own process and goes on past a failure",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
