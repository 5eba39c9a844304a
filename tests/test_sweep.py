"""Sweeps: the driver expands Hydra sweeps, runs each point as its own launch, survives failed points,
and writes a summary table and a throughput heatmap.

The end-to-end test runs a 2 x 2 sweep (sub_batch_size x num_sub_batches) of the tiny model on the
CPU, one process per point; the point with the largest batch is made to run out of memory
(``FSDP_SPEEDLOADER_INJECT_FAULT=oom:min_batch_size=8``, the memory wall a GPU would hit).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from fsdp_speedloader.app.sweep import main as sweep_main
from fsdp_speedloader.app.sweep import (expand_points, launcher_prefix, point_command, point_label, split_overrides,
                                    sweep_axes)
from fsdp_speedloader.app.sweep_report import (classify, heatmap_layout, markdown_table, plot_heatmap,
                                           summarize_metrics, summary_from_hydra_multirun)
from launch_utils import TINY_OVERRIDES, clean_env, read_metrics, tail

SWEEP = ["sweep=sub_batches", "schedule.sub_batch_size=1,2", "schedule.num_sub_batches=2,4"]


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
def test_sweep_runs_every_point_records_the_failed_one_and_summarises(tmp_path):
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "fsdp_speedloader.app.sweep", *TINY_OVERRIDES, "steps=3", *SWEEP,
           f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=clean_env(tmp_path, FSDP_SPEEDLOADER_INJECT_FAULT="oom:min_batch_size=8"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, tail(proc.stdout + proc.stderr)

    summary = json.loads((sweep_dir / "summary.json").read_text())
    assert summary["group"] == "sweep_sub_batches"  # from conf/sweep/sub_batches.yaml
    assert summary["axes"] == ["schedule.sub_batch_size", "schedule.num_sub_batches"]  # the command line's values
    points = summary["points"]
    assert [(p["params"]["schedule.sub_batch_size"], p["params"]["schedule.num_sub_batches"]) for p in points] == [
        ("1", "2"), ("1", "4"), ("2", "2"), ("2", "4")]
    assert [p["status"] for p in points] == ["ok", "ok", "ok", "oom"]  # the sweep went on past... and recorded it
    assert points[3]["returncode"] != 0 and "out of memory" in points[3]["error"]
    for p in points[:3]:
        assert p["metrics"]["steps"] == 3 and p["metrics"]["tokens_per_s"] > 0
        run_dir = sweep_dir / str(p["index"])
        assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
        tokens = int(p["params"]["schedule.sub_batch_size"]) * int(p["params"]["schedule.num_sub_batches"]) * 32
        assert read_metrics(run_dir)[-1]["tokens"] == 3 * tokens  # each point really ran its own batch
        hydra_cfg = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
        assert hydra_cfg["logger"]["group"] == "sweep_sub_batches"  # one W&B group ...
        assert hydra_cfg["logger"]["name"] == f"sweep_sub_batches-{point_label(p['params'])}"  # ... a run per point

    table = (sweep_dir / "summary.md").read_text()
    assert "| 3 | 2 | 4 | **oom** |" in table and table.count("| ok |") == 3
    png = sweep_dir / "heatmap.png"
    if _has_matplotlib():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists() and "pip install matplotlib" in proc.stderr


def test_a_sweep_over_any_key_runs(tmp_path):
    # A point's label names the other keys as key=value (lr=0.002): quoted in logger.name, not an override's '='.
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "fsdp_speedloader.app.sweep", *TINY_OVERRIDES, "steps=1", "optim.lr=1e-3,2e-3",
           f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, tail(proc.stdout + proc.stderr)
    points = json.loads((sweep_dir / "summary.json").read_text())["points"]
    assert [p["status"] for p in points] == ["ok", "ok"], points
    names = [yaml.safe_load((sweep_dir / str(p["index"]) / ".hydra" / "config.yaml").read_text())["logger"]["name"]
             for p in points]
    assert [n.rsplit("-", 1)[-1] for n in names] == ["lr=0.001", "lr=0.002"], names  # <group>-<label>
    again = subprocess.run(cmd, cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "hydra.sweep.dir: " in again.stderr and "holds an earlier sweep" in again.stderr


# --- the pieces, without processes ---------------------------------------------------------------


def test_axes_come_from_the_sweep_config_and_the_command_line():
    fixed, swept = split_overrides(["experiment=tiny_cpu", "schedule.num_sub_batches=2,8",
                                    "schedule.blocks_per_unit=1,2", "steps=3"])
    assert fixed == ["experiment=tiny_cpu", "steps=3"]
    axes = sweep_axes({"schedule.sub_batch_size": "1,2,4", "schedule.num_sub_batches": "2,4,8"}, swept)
    # The command line wins for num_sub_batches; blocks_per_unit is added.
    assert axes == {"schedule.sub_batch_size": ["1", "2", "4"], "schedule.num_sub_batches": ["2", "8"],
                    "schedule.blocks_per_unit": ["1", "2"]}
    points = expand_points(axes)
    assert len(points) == 12
    assert points[:2] == [{"schedule.sub_batch_size": "1", "schedule.num_sub_batches": "2", "schedule.blocks_per_unit": "1"},
                          {"schedule.sub_batch_size": "1", "schedule.num_sub_batches": "2", "schedule.blocks_per_unit": "2"}]
    assert point_label(points[1]) == "n1-N2-bpu2"
    # One value on the command line pins a key the sweep file sweeps (Hydra's rule too).
    assert sweep_axes({"schedule.sub_batch_size": "1,2,4", "schedule.num_sub_batches": "2,4,8"}, {},
                      ["schedule.sub_batch_size=2"]) == {"schedule.num_sub_batches": ["2", "4", "8"]}


def test_each_point_is_one_run_launched_by_python_or_torchrun(tmp_path):
    point = {"schedule.sub_batch_size": "2", "schedule.num_sub_batches": "4"}
    one = point_command(launcher_prefix(1, python="py"), ["sweep=sub_batches"], point, run_dir=tmp_path / "0",
                        group="g", name="g-n2-N4")
    assert one == ["py", "-m", "fsdp_speedloader.app.train", "sweep=sub_batches", "schedule.sub_batch_size=2",
                   "schedule.num_sub_batches=4", f"hydra.run.dir={tmp_path / '0'}", "hydra.mode=RUN", "logger.group=g",
                   'logger.name="g-n2-N4"']
    four = launcher_prefix(4, python="py")
    assert four == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
                    "fsdp_speedloader.app.train"]
    nodes = launcher_prefix(8, ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29500"], python="py")
    assert "--standalone" not in nodes and nodes[3:9] == ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                                         "h:29500"]


def test_dry_run_prints_every_point(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FSDP_SPEEDLOADER_RUN_STAMP", "2000-01-01/00-00-00")  # main() sets it; restored after
    assert sweep_main(["--dry-run", "--nproc-per-node", "4", "sweep=sub_batches", "schedule.blocks_per_unit=1,2",
                       f"hydra.sweep.dir={tmp_path}"]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if "torch.distributed.run" in line]
    assert len(commands) == 3 * 3 * 2
    assert all("--nproc-per-node 4" in c and "logger.group=sweep_sub_batches" in c for c in commands)
    assert commands[-1].endswith(f"hydra.run.dir={tmp_path}/17 hydra.mode=RUN logger.group=sweep_sub_batches "
                                 "'logger.name=\"sweep_sub_batches-n4-N8-bpu2\"'")
    assert not any(tmp_path.iterdir())  # nothing ran


def test_status_of_a_point():
    assert classify(0, "") == "ok"
    assert classify(1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB") == "oom"
    assert classify(1, "error: data.path: ...") == "failed"
    assert classify(-9, "", timed_out=True) == "timeout"


def test_summary_of_metrics_skips_the_warmup_step_and_repeated_steps():
    records = [{"step": 1, "tokens_per_s": 10.0, "loss": 5.0, "peak_gpu_mem_allocated_gib": 3.0,
                "gpu_alloc_retries": 9, "mfu": 0.1},
               {"step": 2, "tokens_per_s": 100.0, "loss": 4.0, "peak_gpu_mem_allocated_gib": 2.0,
                "gpu_alloc_retries": 2, "mfu": 0.4},
               {"step": 3, "tokens_per_s": 999.0, "loss": 3.5, "gpu_alloc_retries": 5},
               {"step": 3, "tokens_per_s": 120.0, "loss": 3.0, "gpu_alloc_retries": 1}]  # step 3 again: the last counts
    m = summarize_metrics(records)
    assert m["steps"] == 3 and m["final_loss"] == 3.0 and m["tokens_per_s"] == 110.0
    assert m["peak_gpu_mem_allocated_gib"] == 3.0
    assert m["gpu_alloc_retries"] == 3  # after the warm-up step
    assert m["mfu"] == 0.4  # the steps after the warm-up that carry it
    cpu = summarize_metrics([{"step": 1, "loss": 1.0, "mfu": 3.6e-5}])  # a CPU run: no figure, no MFU
    assert cpu["gpu_alloc_retries"] is None and cpu["mfu"] is None
    assert summarize_metrics([]) == {}


def _summary(statuses: dict) -> dict:
    points = []
    for i, ((bpu, n, big_n), status) in enumerate(statuses.items()):
        points.append({"index": i, "status": status,
                       "params": {"schedule.sub_batch_size": n, "schedule.num_sub_batches": big_n,
                                  "schedule.blocks_per_unit": bpu},
                       "metrics": {"tokens_per_s": 1000.0 * (i + 1)} if status == "ok" else {}})
    return {"group": "g", "axes": ["schedule.blocks_per_unit", "schedule.sub_batch_size", "schedule.num_sub_batches"],
            "points": points}


def test_table_and_heatmap_with_a_third_swept_key(tmp_path):
    summary = _summary({("1", "1", "2"): "ok", ("1", "1", "8"): "ok", ("1", "2", "2"): "ok", ("1", "2", "8"): "oom",
                        ("2", "1", "2"): "ok", ("2", "1", "8"): "ok", ("2", "2", "2"): "timeout", ("2", "2", "8"): "oom"})
    assert heatmap_layout(summary["points"], summary["axes"]) == (
        "schedule.sub_batch_size", "schedule.num_sub_batches", ["schedule.blocks_per_unit"])
    table = markdown_table(summary["points"], summary["axes"])
    assert table.count("\n") == 2 + 8 - 1 and "**timeout**" in table and "| 1,000 |" in table
    assert "| allocator retries |" in table
    if not _has_matplotlib():
        assert plot_heatmap(summary, tmp_path / "h.png") is None
        return
    png = plot_heatmap(summary, tmp_path / "h.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_of_a_plain_hydra_multirun(tmp_path):
    for i, (n, ok) in enumerate([("1", True), ("2", False)]):
        run = tmp_path / str(i)
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["experiment=tiny_cpu",
                                                                      f"schedule.sub_batch_size={n}"]))
        if ok:
            (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "tokens_per_s": 5.0, "loss": 1.0}) + "\n")
    summary = summary_from_hydra_multirun(tmp_path)
    assert summary["axes"] == ["schedule.sub_batch_size"]
    assert [(p["params"], p["status"]) for p in summary["points"]] == [
        ({"schedule.sub_batch_size": "1"}, "ok"), ({"schedule.sub_batch_size": "2"}, "failed")]
    # the report reads the multirun again each time (it read its own first summary.json ever after)
    from fsdp_speedloader.app.sweep_report import main as report_main

    assert report_main([str(tmp_path)]) == 0
    (tmp_path / "1" / "metrics.jsonl").write_text(json.dumps({"step": 1, "tokens_per_s": 7.0, "loss": 1.0}) + "\n")
    assert report_main([str(tmp_path)]) == 0
    assert [p["status"] for p in json.loads((tmp_path / "summary.json").read_text())["points"]] == ["ok", "ok"]
    with pytest.raises(SystemExit):  # one line, not a traceback
        report_main([str(tmp_path / "nowhere")])


def test_a_hydra_multirun_stopped_by_a_failing_point_reports_the_points_it_never_ran(tmp_path):
    # Hydra's basic launcher stops at the first failing point; the report names the failure and the points left
    # (from the multirun's multirun.yaml), instead of "the points do not differ"
    sweep_dir = tmp_path / "mr"
    cmd = [sys.executable, "-m", "fsdp_speedloader.app.train", "-m", *TINY_OVERRIDES, "steps=1",
           "schedule.sub_batch_size=0,1,2", f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "schedule.sub_batch_size: got 0" in proc.stderr
    assert sorted(p.name for p in sweep_dir.iterdir() if p.name.isdigit()) == ["0"]
    summary = summary_from_hydra_multirun(sweep_dir)
    assert summary["axes"] == ["schedule.sub_batch_size"]
    assert [(p["params"], p["status"]) for p in summary["points"]] == [
        ({"schedule.sub_batch_size": "0"}, "failed"), ({"schedule.sub_batch_size": "1"}, "not run"),
        ({"schedule.sub_batch_size": "2"}, "not run")]
    assert "got 0; must be >= 1" in summary["points"][0]["error"]
    report = subprocess.run([sys.executable, "-m", "fsdp_speedloader.app.sweep_report", str(sweep_dir)],
                            env=clean_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "2 of 3 points did not run" in report.stderr and "fsdp_speedloader.app.sweep" in report.stderr
    assert "Not run: #1, #2" in report.stdout


def test_progress_bar_over_the_points_with_the_lines_above_it(tmp_path, monkeypatch, capfd):
    """The driver shows a bar over the points (terminal only, or ``FSDP_SPEEDLOADER_PROGRESS=1``) and prints a first
    line before Hydra composes; the per-point lines still go to stdout."""
    import fsdp_speedloader.app.sweep as sweep_mod
    from fsdp_speedloader.app.logger import PROGRESS_ENV

    fake = {"returncode": 0, "status": "ok", "error": None, "wall_s": 0.0, "metrics": {"tokens_per_s": 100.0}}
    monkeypatch.setattr(sweep_mod, "run_point", lambda *a, **k: dict(fake))
    monkeypatch.setenv("FSDP_SPEEDLOADER_RUN_STAMP", "2000-01-01/00-00-00")
    argv = ["--no-heatmap", "sweep=sub_batches", "schedule.sub_batch_size=1,2", "schedule.num_sub_batches=2",
            "logger=none"]
    monkeypatch.setenv(PROGRESS_ENV, "1")
    capfd.readouterr()
    assert sweep_mod.main([*argv, f"hydra.sweep.dir={tmp_path / 'bar'}"]) == 0
    out, err = capfd.readouterr()
    assert out.splitlines()[0] == "sweep: composing the config ..."
    assert "sweep: [1/2] n1 ... ok, 100 tokens/s" in out and "sweep: [2/2] n2 ... ok" in out
    assert "sweep: 100%" in err and "2/2" in err and "point" in err, err[-2000:]

    monkeypatch.delenv(PROGRESS_ENV)  # pytest's stderr is not a terminal: no bar, the same lines
    assert sweep_mod.main([*argv, f"hydra.sweep.dir={tmp_path / 'plain'}"]) == 0
    out, err = capfd.readouterr()
    assert "sweep: [1/2] n1 ... ok, 100 tokens/s" in out and "sweep:" not in err
