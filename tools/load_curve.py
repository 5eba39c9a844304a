"""The busy-host curve from tools/bench_fair.py records of one table: how much speed each row loses to a host load,
and how much more than the on-device ceiling loses (issue 40's target: at most 5 points more with 4 busy cores).

    python tools/load_curve.py QUIET.json LOADED.json [LOADED.json ...] [--json OUT.json]

QUIET is the table's record without load; each LOADED one was made with ``--host-busy K`` (and/or ``--host-copy M``).
A row is one worker spec, present in both records. Two readings, both kept:

  over the records   the loss of the row's median over all invocations of each record;
  start by start     for each start of the machine (boot id) that ran the row in both records, the loss of that
                     start's median: a start's host runs every row at its own speed (starts differ by a few percent
                     with no load at all), so this pairing leaves the load alone in the difference.

``beyond_ceiling`` is a row's loss less the ceiling's, in the same reading (positive: the row lost more).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
from bench_fair import family_of  # noqa: E402

CEILING = "ceiling"


def rows_by_spec(record: dict, key: str = "tokens_per_s") -> dict[str, dict[str, list[float]]]:
    """{spec: {boot id: [``key`` of each invocation that ran]}} over a record's repeat invocations."""
    out: dict[str, dict[str, list[float]]] = {}
    for inv in record["invocations"]:
        boot = inv.get("boot_id") or f"unknown {inv['index']}"
        for row in inv["rows"]:
            if row.get("status") == "ok" and row.get(key):
                out.setdefault(row["spec"], {}).setdefault(boot, []).append(row[key])
    return out


def loss(quiet: float, loaded: float) -> float:
    """The fraction of the quiet speed lost under load (negative: it ran faster)."""
    return 1.0 - loaded / quiet


def load_losses(quiet: dict, loaded: dict, key: str = "tokens_per_s") -> dict:
    """Per spec in both records: its loss over the records' medians and start by start, and the same less the
    ceiling's (``beyond_ceiling``) where the ceiling ran in both."""
    q, l = rows_by_spec(quiet, key), rows_by_spec(loaded, key)
    rows = {}
    for spec in q.keys() & l.keys():
        overall = loss(statistics.median(v for vs in q[spec].values() for v in vs),
                       statistics.median(v for vs in l[spec].values() for v in vs))
        by_start = {boot: loss(statistics.median(q[spec][boot]), statistics.median(l[spec][boot]))
                    for boot in sorted(q[spec].keys() & l[spec].keys())}
        rows[spec] = {"family": family_of(spec), "loss": overall, "by_start": by_start}
    ceiling = next((r for r in rows.values() if r["family"] == CEILING), None)
    for r in rows.values():
        if ceiling is None or r is ceiling:
            continue
        r["beyond_ceiling"] = r["loss"] - ceiling["loss"]
        r["beyond_ceiling_by_start"] = {boot: v - ceiling["by_start"][boot] for boot, v in r["by_start"].items()
                                        if boot in ceiling["by_start"]}
    return {"host_load": loaded.get("host_load"), "rows": rows}


def markdown(curve: Sequence[dict]) -> str:
    lines = ["| load | row | loss over the records | start by start | beyond the ceiling (records / by start) |",
             "|---|---|---|---|---|"]
    for point in curve:
        load = point["host_load"] or {}
        name = f"{load.get('busy', 0)} busy" + (f", {load['copy']} copying" if load.get("copy") else "")
        for spec, r in sorted(point["rows"].items(), key=lambda kv: (kv[1]["family"] != CEILING, kv[0])):
            starts = ", ".join(f"{v:+.1%} ({boot[:8]})" for boot, v in r["by_start"].items()) or "-"
            beyond = "-"
            if "beyond_ceiling" in r:
                paired = ", ".join(f"{v:+.1%} ({boot[:8]})" for boot, v in r["beyond_ceiling_by_start"].items()) or "-"
                beyond = f"{r['beyond_ceiling']:+.1%} / {paired}"
            lines.append(f"| {name} | {spec} | {r['loss']:+.1%} | {starts} | {beyond} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("quiet", help="the table's record without host load")
    parser.add_argument("loaded", nargs="+", help="records of the same table made under --host-busy/--host-copy")
    parser.add_argument("--json", help="also write the curve here")
    args = parser.parse_args(argv)
    quiet = json.loads(Path(args.quiet).read_text())
    curve = []
    for path in args.loaded:
        loaded = json.loads(Path(path).read_text())
        if loaded["table"]["name"] != quiet["table"]["name"] or loaded["device"] != quiet["device"]:
            parser.error(f"{path} is {loaded['table']['name']} on {loaded['device']}, {args.quiet} is "
                         f"{quiet['table']['name']} on {quiet['device']}: a curve compares one table on one GPU model")
        curve.append({"record": path, **load_losses(quiet, loaded)})
    print(markdown(curve))
    if args.json:
        Path(args.json).write_text(json.dumps({"quiet": args.quiet, "curve": curve}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
