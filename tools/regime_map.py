"""The regime map (issue 39): where layer-major beats the best canonical offloading peer, from tools/bench_fair.py
records of the map's tables (and the 7B-width headline tables, which are map points too).

    python tools/regime_map.py RECORD.json [RECORD.json ...] [--json OUT.json] [--plot OUT.png]

One point per table: layer-major against the faster of FSDP2 CPU offload and DeepSpeed ZeRO-3 offload. A family's
figure is the median of its best point over the record's repeat invocations; a family with no repeat yet takes its
best sweep point, and the point says so (``status``):

  protocol     every figure of the point is a median of at least 3 invocations
  repeat k/3   a repeat part ran, fewer than 3 invocations so far (``--partial``)
  sweep only   no repeat: one sweep invocation of each best point

``peer_head`` says how the peers computed their loss: ``chunked`` (layer-major's head, 4096 tokens of logits at a
time: every peer row since e2a292b, whose ``head_loss_chunk_tokens`` is > 0) or ``own`` (the model's own loss,
every logit of a micro-batch at once: rows without the field predate it, and their peers' micro-batches were held
smaller by that memory); ``mixed`` where the record holds both.

``target`` is the issue's ratio for the point (2x where the best peer's micro-batch is an eighth of the batch or
less, 1.3x where the cap binds it, else 1x: not slower); ``bound`` the most any schedule of the same kernels could
reach over that peer (where the record has the ceiling: the fastest forward+backward rate of its repeated
contenders, usually the ceiling's). Families that never
ran at the point are listed under ``not_run``; a sweep stopped part-way (micro-batches of a family not run yet, where
its best point may lie) under ``sweep_pending``. Records under a host load (``--host-busy``) are refused, as are
records of two GPU models in one map. With several records of one table the one with the most repeat invocations
is used.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
import bench_fair  # noqa: E402
import harness  # noqa: E402
import protocol  # noqa: E402
from bench_fair import AUTO, LAYER_MAJOR, PEERS  # noqa: E402

# The 7B-width grid's axes (the plot's heatmap); other points (13B width, 16k tokens) sit beside it.
GRID_CAPS = (24, 40, 80)
GRID_BATCHES = (8, 32, 128)


def family_figure(record: dict, summary: dict, table: bench_fair.Table, family: str) -> Optional[dict]:
    """A family's figure at the point: its repeat median (with min-max and invocations), else its best sweep point
    (n = 0); None where no point of it ran."""
    entry = summary["families"].get(family)
    if entry and entry.get("median"):
        return {"spec": entry["spec"], "tokens_per_s": entry["median"], "min": entry["min"], "max": entry["max"],
                "n": entry["n"], "sub_batch_size": entry.get("sub_batch_size"), "source": "repeat"}
    row = protocol.best_point([r for r in record.get("sweep", []) if r["family"] == family], key=table.figure)
    if row is None:
        return None
    return {"spec": row["spec"], "tokens_per_s": row[table.figure], "n": 0, "sub_batch_size": row.get("sub_batch_size"),
            "source": "sweep"}


def map_point(record: dict) -> dict:
    """The point of one record: layer-major, the best peer, their ratio, the target and bound, and the status."""
    table = bench_fair.TABLES[record["table"]["name"]]
    summary = bench_fair.summarize(record, table)
    figures = {f: fig for f in (LAYER_MAJOR, *PEERS) if (fig := family_figure(record, summary, table, f))}
    point = {"table": table.name, "model": table.model, "layers": table.layers, "seq_len": table.seq_len,
             "batch": table.batch, "cap_gib": table.cap_gib, "device": record["device"], "families": figures,
             "not_run": [f for f in (LAYER_MAJOR, *PEERS) if f not in figures],
             "sweep_pending": {f: left for f, left in summary["sweep_pending"].items() if f in (LAYER_MAJOR, *PEERS)},
             "peer_head": bench_fair.peer_head(record)}
    ours = figures.get(LAYER_MAJOR)
    peers = [(figures[p]["tokens_per_s"], p) for p in PEERS if p in figures]
    if ours is None or not peers:
        point["status"] = "incomplete"
        return point
    best = max(peers)[1]
    theirs = figures[best]
    point["best_peer"] = best
    point["ratio"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
    n = min(ours["n"], theirs["n"])
    if ours["source"] == theirs["source"] == "repeat":
        # the record's ratio: medians over the invocations both ran in (bench_fair.ratio_of)
        r = summary["ratios"][f"{LAYER_MAJOR}/{best}"]
        point.update(ratio=r["ratio"], overlap=r["overlap"], separate_invocations=r["separate_invocations"])
        if r.get("invocations"):
            point["invocations"], n = r["invocations"], len(r["invocations"])
    point["status"] = ("separate invocations" if point.get("separate_invocations") else "protocol"
                       if n >= protocol.MIN_INVOCATIONS else f"repeat {n}/{protocol.MIN_INVOCATIONS}"
                       if n else "sweep only")
    auto = family_figure(record, summary, table, AUTO)  # the trainer's own choice of schedule, where it ran
    if auto:
        r = summary["ratios"].get(f"{AUTO}/{best}")
        point["auto"] = {**auto, "schedule": _auto_schedule(record, auto["spec"]),
                         "ratio": r["ratio"] if r and auto["source"] == theirs["source"] == "repeat" else
                         auto["tokens_per_s"] / theirs["tokens_per_s"]}
    if theirs.get("sub_batch_size"):
        point["target"] = bench_fair.peer_case(table, theirs["sub_batch_size"])["target"]
    fastest = bench_fair.fastest_fwd_bwd(summary["families"])
    if fastest:
        point["bound"] = fastest / theirs["tokens_per_s"]
    return point


def _auto_schedule(record: dict, spec: str) -> Optional[str]:
    """The schedule the auto rows of ``spec`` ran ('speedloader', 'canonical'; 'mixed' where invocations differ)."""
    rows = bench_fair.record_rows(record)
    chosen = {r.get("schedule") for r in rows if r.get("spec") == spec and r.get("status") == "ok"}
    return None if not chosen else chosen.pop() if len(chosen) == 1 else "mixed"


def choose_records(records: Sequence[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """One record per table (the one with the most repeat invocations); refuses loaded hosts and mixed GPU models."""
    devices = {r["device"] for _, r in records}
    if len(devices) > 1:
        raise SystemExit(f"records of {sorted(devices)}: a map compares points on one GPU model")
    chosen: dict[str, tuple[str, dict]] = {}
    for path, record in records:
        load = record.get("host_load") or {}
        if load.get("busy") or load.get("copy"):
            raise SystemExit(f"{path} was made under a host load ({load}): the map is of quiet hosts")
        name = record["table"]["name"]
        if name not in bench_fair.TABLES or record["table"].get("kind") != "train":
            raise SystemExit(f"{path}: {name} is not a training table of tools/bench_fair.py")
        if not bench_fair.same_table(record["table"], bench_fair.TABLES[name]):
            raise SystemExit(f"{path} holds another definition of {name} than tools/bench_fair.py's: not a map point")
        if name not in chosen or len(record["invocations"]) > len(chosen[name][1]["invocations"]):
            chosen[name] = (path, record)
    tables = {name: bench_fair.TABLES[name] for name in chosen}
    return [chosen[name] for name in sorted(chosen, key=lambda n: (tables[n].model, tables[n].seq_len,
                                                                  tables[n].cap_gib, tables[n].batch))]


def _label(point: dict) -> str:
    width = {"llama2_7b": "7B", "llama2_13b": "13B"}.get(point["model"], point["model"])
    tokens = f"{point['seq_len'] // 1024}k" if point["seq_len"] % 1024 == 0 else str(point["seq_len"])
    return f"{width} width, {point['layers']} layers, {point['batch']} x {tokens}, {point['cap_gib']:g} GiB"


def _figure(fig: Optional[dict]) -> str:
    if fig is None:
        return "not run"
    spread = f" ({fig['min']:,.0f}-{fig['max']:,.0f}, n={fig['n']})" if fig["source"] == "repeat" else " (sweep)"
    return f"{fig['tokens_per_s']:,.0f}{spread}"


def markdown(points: Sequence[dict]) -> str:
    lines = ["| point | layer-major | best peer | ratio | target / bound | status |", "|---|---|---|---|---|---|"]
    for p in points:
        peer = p.get("best_peer")
        peer_text = f"{peer} {_figure(p['families'][peer])}" if peer else "not run"
        ratio = f"{p['ratio']:.2f}x" + (" (ranges overlap)" if p.get("overlap") else "") if "ratio" in p else "-"
        target = (f"{p['target']:g}x" if "target" in p else "-") + (f" / {p['bound']:.2f}x" if "bound" in p else "")
        missing = f"; not run: {', '.join(p['not_run'])}" if p["not_run"] else ""
        missing += "".join(f"; {f}'s sweep partial ({len(left)} micro-batch{'es' if len(left) > 1 else ''} to run)"
                           for f, left in p.get("sweep_pending", {}).items())
        if p.get("peer_head") in ("own", "mixed"):
            missing += f"; peers' loss: {'every logit at once' if p['peer_head'] == 'own' else 'mixed'} (before e2a292b)"
        if "auto" in p:
            missing += f"; schedule=auto {p['auto']['ratio']:.2f}x ({p['auto']['schedule']}, {_figure(p['auto'])})"
        lines.append(f"| {_label(p)} | {_figure(p['families'].get(LAYER_MAJOR))} | {peer_text} | {ratio} | {target} "
                     f"| {p['status']}{missing} |")
    return "\n".join(lines)


def _cell(point: Optional[dict]) -> tuple[Optional[float], str]:
    if point is None:
        return None, "not measured"
    if "ratio" not in point:
        return None, "no " + " / ".join(point["not_run"])
    partial = any(f in point.get("sweep_pending", {}) for f in PEERS)
    stale = point.get("peer_head") in ("own", "mixed")  # the peers' micro-batches held smaller by every logit at once
    return point["ratio"], (f"{point['ratio']:.2f}x\n{point['status']}" + ("\npeer sweep partial" if partial else "")
                            + ("\npeers: every logit at once" if stale else "")
                            + (f"\nschedule=auto {point['auto']['ratio']:.2f}x" if "auto" in point else ""))


def _on_grid(model: str, layers: Optional[int], seq_len: int) -> bool:
    return model == "llama2_7b" and layers == 8 and seq_len == 4096


def plot(points: Sequence[dict], path: str) -> Optional[Path]:
    """The 7B-width grid (GPU-memory cap x effective batch) as a heatmap of layer-major over the best peer, and the
    map's other points (13B width, 16k tokens) beside it; cells not measured yet left grey."""
    plt = harness.pyplot("regime_map")
    if plt is None:
        return None
    from matplotlib.colors import TwoSlopeNorm

    grid = {(p["cap_gib"], p["batch"]): p for p in points if _on_grid(p["model"], p["layers"], p["seq_len"])}
    measured = {p["table"]: p for p in points}
    others = [t for t in bench_fair.TABLES.values() if t.name.startswith("map_") and t.kind == "train"
              and not _on_grid(t.model, t.layers, t.seq_len)]
    norm = TwoSlopeNorm(vmin=0.5, vcenter=1.0, vmax=2.5)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, len(others)]})

    def draw(ax, cells, rows, cols, title):
        ax.imshow([[_cell(cells.get((r, c)))[0] or float("nan") for c in cols] for r in rows], cmap="RdYlGn",
                  norm=norm, aspect="auto")
        ax.set_facecolor("0.85")
        for i, r in enumerate(rows):
            for j, c in enumerate(cols):
                ax.text(j, i, _cell(cells.get((r, c)))[1], ha="center", va="center", fontsize=8)
        ax.set_title(title, fontsize=10)

    draw(axes[0], grid, GRID_CAPS, GRID_BATCHES, "7B width, 8 layers, 4096 tokens: layer-major / best peer")
    axes[0].set_xticks(range(len(GRID_BATCHES)), [f"batch {b}" for b in GRID_BATCHES])
    axes[0].set_yticks(range(len(GRID_CAPS)), [f"{c} GiB" for c in GRID_CAPS])
    draw(axes[1], {(0, i): measured.get(t.name) for i, t in enumerate(others)}, (0,), range(len(others)),
         "the map's other points")
    labels = [_label({"model": t.model, "layers": t.layers, "batch": t.batch, "seq_len": t.seq_len,
                      "cap_gib": t.cap_gib}).replace(", ", "\n") for t in others]
    axes[1].set_xticks(range(len(others)), labels, fontsize=7)
    axes[1].set_yticks([])
    return harness.save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="+", help="tools/bench_fair.py records of training tables, one GPU model")
    parser.add_argument("--json", help="also write the points here")
    parser.add_argument("--plot", help="also draw the map here (PNG; needs matplotlib: pip install -e '.[plots]')")
    args = parser.parse_args(argv)
    records = [(path, json.loads(Path(path).read_text())) for path in args.records]
    points = [{"record": path, **map_point(record)} for path, record in choose_records(records)]
    print(markdown(points))
    if args.json:
        Path(args.json).write_text(json.dumps({"points": points}, indent=2) + "\n")
    if args.plot:
        plot(points, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
