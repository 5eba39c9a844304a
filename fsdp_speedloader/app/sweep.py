"""Sweep driver: every point of a Hydra sweep as its own training launch, then a summary and a heatmap.

    python -m fsdp_speedloader.app.sweep sweep=sub_batches experiment=tiny_cpu                 # one process
    python -m fsdp_speedloader.app.sweep --nproc-per-node 4 sweep=sub_batches experiment=llama2_7b_offload
    python -m fsdp_speedloader.app.sweep --nproc-per-node 8 sweep=sub_batches schedule.blocks_per_unit=1,2

The arguments are ``python -m fsdp_speedloader.app.train``'s Hydra overrides. The swept keys are
``hydra.sweeper.params`` of the composed config (what ``sweep=NAME`` sets) and any comma list on
the command line (``schedule.blocks_per_unit=1,2``: the command line wins for a key in both); the
points are their cartesian product, in Hydra's order. Each point runs as a separate process:

- ``--nproc-per-node 1``: ``python -m fsdp_speedloader.app.train <overrides> <point>``;
- ``--nproc-per-node G``: ``torchrun --standalone --nproc-per-node G -m fsdp_speedloader.app.train ...``
  (``--torchrun-args "--nnodes 2 --rdzv-backend c10d ..."`` replaces ``--standalone``),

with ``hydra.run.dir=<sweep dir>/<index>``, ``logger.group=<group>`` and ``logger.name=<group>-<point>``,
so every point is its own W&B run and all are in one group (``logger.group`` of the config, e.g.
``sweep_sub_batches``, or ``sweep-<date>-<time>``). A process per point means a point that runs out of
memory, hangs (``--timeout``) or crashes cannot take the sweep down, and a rank that dies takes its
torchrun group with it: the point is recorded as ``oom``, ``timeout`` or ``failed`` and the sweep goes
on. Each point's output is in ``<sweep dir>/<index>/console.log``.

After every point ``summary.json`` and ``summary.md`` are rewritten in the sweep directory
(``hydra.sweep.dir``, default ``multirun/DATE/TIME``); at the end ``heatmap.png`` (matplotlib, optional)
and, when ``logger=wandb``, a ``<group>-summary`` W&B run in the same group with the table and the
heatmap. Exit status: 0 when at least one point ran, 1 when none did. On a terminal (or with
``FSDP_SPEEDLOADER_PROGRESS=1``) a progress bar counts the points done, the per-point lines printed above it.

``python -m fsdp_speedloader.app.train sweep=NAME`` (Hydra's own multirun, in one process, one point
after another) also works for quick single-process sweeps; ``python -m fsdp_speedloader.app.sweep_report
DIR`` summarises its directory. This driver is the robust way, and the only one for several GPUs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import OmegaConf

from fsdp_speedloader.app.cli import check_overrides
from fsdp_speedloader.app.config import LoggerConfig
from fsdp_speedloader.app.launch import fail
from fsdp_speedloader.app.logger import StepProgress, progress_bar_enabled
from fsdp_speedloader.app.sweep_points import expand_points, split_overrides, sweep_axes
from fsdp_speedloader.app.sweep_report import classify, read_metrics, summarize_metrics, write_report

RUN_LOG = "console.log"
_MULTIRUN_FLAGS = ("-m", "--multirun")


def point_label(point: dict[str, str]) -> str:
    """``n2-N4-bpu1``-style short name of a point (the last part of each key)."""
    short = {"sub_batch_size": "n", "num_sub_batches": "N", "blocks_per_unit": "bpu"}
    parts = []
    for key, value in point.items():
        leaf = key.split(".")[-1]
        parts.append(f"{short[leaf]}{value}" if leaf in short else f"{leaf}={value}")
    return "-".join(parts)


def launcher_prefix(nproc_per_node: int, torchrun_args: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """How one point starts: plain python for one process, torchrun otherwise."""
    if nproc_per_node == 1 and not torchrun_args:
        return [python, "-m", "fsdp_speedloader.app.train"]
    rendezvous = list(torchrun_args) or ["--standalone"]
    return [python, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node", str(nproc_per_node),
            "-m", "fsdp_speedloader.app.train"]


def point_command(prefix: Sequence[str], fixed: Sequence[str], point: dict[str, str], *, run_dir: str | Path,
                  group: str, name: Optional[str]) -> list[str]:
    """The full command line of one point (a single run: ``hydra.mode=RUN`` beats a sweep file's MULTIRUN)."""
    extra = [f"hydra.run.dir={run_dir}", "hydra.mode=RUN", f"logger.group={group}"]
    if name is not None:  # quoted: a point's label holds '=' (model=opt_tiny), which Hydra reads as an override's
        extra.append(f"logger.name={hydra_quoted(name)}")
    return [*prefix, *fixed, *(f"{k}={v}" for k, v in point.items()), *extra]


def hydra_quoted(value: str) -> str:
    """``value`` as a quoted string of Hydra's override grammar (its quotes escaped)."""
    return '"' + value.replace('"', '\\"') + '"'


def run_point(command: Sequence[str], run_dir: Path, *, timeout_s: Optional[float], env: Optional[dict] = None) -> dict:
    """Runs one point to its end (or its timeout); returns exit code, status, error tail, figures."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / RUN_LOG
    start, timed_out = time.monotonic(), False
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(command) + "\n")
        log.flush()
        # Own session: on a timeout the whole torchrun group goes, not only its agent.
        proc = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            returncode = proc.returncode
    output = log_path.read_text(errors="replace")
    status = classify(returncode, output, timed_out=timed_out)
    error = None
    if status != "ok":
        # Hydra's closing advice (HYDRA_FULL_ERROR) is not the reason
        lines = [line for line in output.splitlines() if line.strip() and "HYDRA_FULL_ERROR" not in line]
        errors = [line for line in lines if line.startswith("error:") or "Error" in line]
        error = (errors or lines or [""])[-1][-500:]
    return {"returncode": returncode, "status": status, "error": error, "wall_s": time.monotonic() - start,
            "metrics": summarize_metrics(read_metrics(run_dir))}


def _compose(overrides: Sequence[str]):
    from hydra import compose, initialize_config_dir, initialize_config_module

    from fsdp_speedloader.app.launch import config_path

    path = config_path()
    init = (initialize_config_module(path[len("pkg://"):], version_base="1.3") if path.startswith("pkg://")
            else initialize_config_dir(config_dir=path, version_base="1.3"))
    with init:
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def log_summary_to_wandb(summary: dict, sweep_dir: Path, logger_cfg: LoggerConfig, heatmap: Optional[Path]) -> None:
    """A ``<group>-summary`` run in the sweep's W&B group: the table and the heatmap."""
    import wandb

    from fsdp_speedloader.app.logger import resolve_wandb_mode

    axes = summary["axes"]
    columns = [*axes, "status", "tokens_per_s", "tokens_per_s_per_device", "mfu", "peak_gpu_mem_allocated_gib",
               "gpu_alloc_retries"]
    table = wandb.Table(columns=columns)
    for p in summary["points"]:
        m = p.get("metrics") or {}
        table.add_data(*(p["params"][a] for a in axes), p["status"], *(m.get(c) for c in columns[len(axes) + 1:]))
    run = wandb.init(project=logger_cfg.project, entity=logger_cfg.entity, group=summary["group"],
                     name=f"{summary['group']}-summary", job_type="sweep-summary",
                     mode=resolve_wandb_mode(logger_cfg.mode)[0], dir=str(sweep_dir), config={"axes": axes})
    payload = {"sweep_summary": table}
    if heatmap is not None:
        payload["throughput_heatmap"] = wandb.Image(str(heatmap))
    run.log(payload)
    run.finish()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_speedloader.app.sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="The groups and keys of a point: python -m fsdp_speedloader.app.train "
                                            "--help; every key: docs/configuration.md; sweeps: docs/tuner.md.")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per point (torchrun when > 1)")
    parser.add_argument("--torchrun-args", default="",
                        help="torchrun rendezvous arguments instead of --standalone (quoted, e.g. for several nodes)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before a point is stopped (timeout)")
    parser.add_argument("--no-heatmap", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="print each point's command; run nothing")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for fsdp_speedloader.app.train")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args([a for a in argv if a not in _MULTIRUN_FLAGS])  # every point is one run
    if args.nproc_per_node < 1:
        parser.error("--nproc-per-node must be >= 1")
    try:
        show_bar = progress_bar_enabled(0) and not args.dry_run  # the driver is one process: rank 0's rule
    except ValueError as e:  # FSDP_SPEEDLOADER_PROGRESS not understood
        parser.error(str(e))
    print("sweep: composing the config ...", flush=True)  # the first line, before Hydra composes

    try:  # a typo: one line with the closest names (exit 2), not a traceback from the compose below
        check_overrides("config", args.overrides)
    except ValueError as e:
        fail(e)
    fixed, cli_swept = split_overrides(args.overrides)
    cfg = _compose(fixed)
    axes = sweep_axes(dict(cfg.hydra.sweeper.params or {}), cli_swept, fixed)
    if not axes:
        parser.error("nothing to sweep: pass sweep=NAME (conf/sweep/) or a comma list such as "
                     "schedule.num_sub_batches=2,4,8")
    stamp = os.environ.get("FSDP_SPEEDLOADER_RUN_STAMP") or datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    os.environ["FSDP_SPEEDLOADER_RUN_STAMP"] = stamp  # the default hydra.sweep.dir reads it
    sweep_dir = Path(str(cfg.hydra.sweep.dir)).absolute()
    if not args.dry_run and (sweep_dir / "summary.json").exists():  # its points' runs would mix with this sweep's
        fail(ValueError(f"hydra.sweep.dir: {sweep_dir} holds an earlier sweep (summary.json); choose another "
                        "hydra.sweep.dir (the default is a new dated directory), or move that one away"))
    group = cfg.logger.group or f"sweep-{stamp.replace('/', '-')}"
    user_named = any(o.split("=", 1)[0].lstrip("+~") == "logger.name" for o in fixed)
    prefix = launcher_prefix(args.nproc_per_node, shlex.split(args.torchrun_args))
    points = expand_points(axes)

    summary = {"group": group, "axes": list(axes), "sweep_dir": str(sweep_dir),
               "command": ["python", "-m", "fsdp_speedloader.app.sweep", *argv],
               "nproc_per_node": args.nproc_per_node, "points": []}
    print(f"sweep: {len(points)} points over {', '.join(axes)} -> {sweep_dir} (group {group})", flush=True)
    with StepProgress(total=len(points), enabled=show_bar, desc="sweep", unit="point") as progress:
        for index, point in enumerate(points):
            run_dir = sweep_dir / str(index)
            command = point_command(prefix, fixed, point, run_dir=run_dir, group=group,
                                    name=None if user_named else f"{group}-{point_label(point)}")
            if args.dry_run:
                print(shlex.join(command))
                continue
            progress.update(index, point=point_label(point))
            if not progress.enabled:  # the point's line is finished below; a bar shows the point meanwhile
                print(f"sweep: [{index + 1}/{len(points)}] {point_label(point)} ...", end=" ", flush=True)
            record = {"index": index, "params": point, "run_dir": str(run_dir), "command": command,
                      **run_point(command, run_dir, timeout_s=args.timeout)}
            summary["points"].append(record)
            tps = record["metrics"].get("tokens_per_s")
            outcome = record["status"] + (f", {tps:,.0f} tokens/s" if record["status"] == "ok" and tps else
                                          f" (exit {record['returncode']}; see {run_dir / RUN_LOG})")
            if progress.enabled:
                progress.write(f"sweep: [{index + 1}/{len(points)}] {point_label(point)} ... {outcome}")
            else:
                print(outcome, flush=True)
            progress.update(index + 1, point=point_label(point), last=record["status"])
            write_report(summary, sweep_dir, heatmap=False)  # a sweep cut short still leaves its table
    if args.dry_run:
        return 0

    paths = write_report(summary, sweep_dir, heatmap=not args.no_heatmap)
    print((sweep_dir / "summary.md").read_text())
    print("sweep: wrote " + ", ".join(str(p) for p in paths.values()), flush=True)
    logger_cfg = LoggerConfig(**OmegaConf.to_container(cfg.logger, resolve=True))
    if logger_cfg.backend == "wandb":
        try:
            log_summary_to_wandb(summary, sweep_dir, logger_cfg, paths.get("heatmap"))
        except Exception as e:  # the sweep's own results are on disk; W&B is a copy
            print(f"sweep: could not log the summary to W&B ({type(e).__name__}: {e})", file=sys.stderr)
    return 0 if any(p["status"] == "ok" for p in summary["points"]) else 1


if __name__ == "__main__":
    sys.exit(main())
