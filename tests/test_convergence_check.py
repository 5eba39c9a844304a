"""tools/convergence_check.py end to end on the CPU, short: every mode trains through the Hydra entry point on the
embedded corpus from the same weights and batches, and the record, the plot and one offline W&B run per mode (one
group) exist; the exact control passes by construction (fp32 against itself is 0%), and a few steps of bf16 and
int8 moments and of bf16 master weights stay within the 1% tolerance."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "convergence_check.py"
SMALL = ["--steps", "3", "--window", "2", "--seq-len", "32", "--sub-batch-size", "2", "--override",
         "model.num_layers=2", "--override", "model.hidden_size=64", "--override", "model.intermediate_size=128"]


def _load_tool():
    spec = importlib.util.spec_from_file_location("convergence_check", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


def test_modes_differ_only_in_their_optimizer_settings(tmp_path):
    args = tool.parse_args(SMALL)
    a = tool.mode_overrides(args, "fp32", tmp_path / "a")
    b = tool.mode_overrides(args, "int8", tmp_path / "b")
    differ = {"optim.state_dtype", "optim.master_dtype", "logger.name", "hydra.run.dir"}
    assert {o for o in a if o.split("=")[0] not in differ} == {o for o in b if o.split("=")[0] not in differ}
    assert {"data=default", "offload=params", "optim.overlap_with_backward=true", "optim.grad_clip=0",
            "optim.state_dtype=int8", "logger.mode=offline"} <= set(b)
    c = tool.mode_overrides(args, "bf16-master", tmp_path / "c")
    assert {o for o in a if o.split("=")[0] not in differ} == {o for o in c if o.split("=")[0] not in differ}
    assert {"optim.master_dtype=bf16", "optim.state_dtype=int8"} <= set(c)


def test_a_short_check_runs_and_writes_record_plot_and_wandb_runs(tmp_path):
    code = tool.main([*SMALL, "--name", "conv", "--out-dir", str(tmp_path)])
    record = json.loads((tmp_path / "conv.json").read_text())
    assert code == 0 and record["passed"] and record["wandb_group"] == "conv"
    assert (tmp_path / "conv.png").stat().st_size > 0
    results = record["results"]
    assert list(results) == ["fp32", "bf16", "int8", "bf16-master"]
    first = {mode: r["curve"]["loss"][0] for mode, r in results.items()}
    assert len({first[m] for m in ("fp32", "bf16", "int8")}) == 1  # the same weights and first batch: the same loss
    assert abs(first["bf16-master"] / first["fp32"] - 1) < 1e-3  # the same weights, rounded to bf16
    for mode, r in results.items():
        assert r["status"] == "ok" and r["curve"]["step"] == [1, 2, 3], mode
        assert abs(r["relative_to_fp32"]) <= 0.01 and r["within_tolerance"], mode
        assert len(r["wandb_runs"]) == 1 and (tmp_path / r["run_dir"] / r["wandb_runs"][0]).is_dir(), mode
    assert results["fp32"]["relative_to_fp32"] == 0.0
