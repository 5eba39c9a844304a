"""The tuner's single plan vs an exhaustive sweep over (sub_batch_size, num_sub_batches), on one GPU.

Usage (one GPU, a few minutes; the host limit because the GPU machine's MemTotal starts small and grows):

  FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB=120 python tools/sweep_plan.py --model llama2_7b --layers 8 \\
      --seq-len 4096 --max-gpu-memory-gib 40 --sub-batch-sizes 1,2,4 --num-sub-batches 4,8,16 \\
      --steps 3 --warmup 1 --name sweep_plan_llama7b_L8

1. The tuner, in its own process under the same GPU cap: two trial steps (n = 2, 4), the linear memory
   models, and the plan within the grid's bounds (n <= max of --sub-batch-sizes, N <= max of
   --num-sub-batches), with its predicted peak GPU memory (allocated and reserved) and arena bytes at
   every grid point. Its ``limited_by`` says whether memory or the grid's bounds stopped it. For the
   command above memory binds far outside the grid (docs/tuner.md, Results), beyond what a sweep of a few
   minutes can run, so there the comparison checks that the tuner fills the grid's box. A lower
   FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB moves the host bound into the grid.
2. Every grid point, each in its own process with the same cap: ``tools/bench_train.py``'s worker
   (``speedloader:nxN``: layer-major, parameters offloaded, activations in the pinned host arena, fused
   AdamW; ``--warmup`` untimed steps, then the median of ``--steps`` timed steps). A point that runs out
   of GPU memory is recorded as ``oom``, one whose arena does not fit as ``host_budget``.
3. The plan's point, if it is not in the grid.

Every process inherits the environment, PYTORCH_CUDA_ALLOC_CONF included (recorded): the tuner's reserved
line holds for points run under the same allocator settings.

Reported: the plan's tokens/s (optimizer step included) over the best grid point's (target >= 95%; above
1 when the plan, off the grid, beats it); for every point the tuner's predicted peak GPU memory
(allocated and reserved) and arena bytes against the measured ones; and the
linearity of the measured peaks in n over the whole grid (R^2 with many points, where the tuner's two
points make it 1 by construction). Points run plan first, then by decreasing n x N; ``--time-budget-s``
skips what would not finish in time (recorded as ``skipped``). Writes bench/results/<name>.json and
<name>.md and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(TOOLS))
import bench_train  # noqa: E402  (the contenders' model shapes)
import harness  # noqa: E402

GIB = float(1 << 30)


def _ints(text: str) -> list[int]:
    return sorted({int(v) for v in text.split(",") if v.strip()})


def _align(nbytes: int) -> int:
    from fsdp_speedloader.memory.arena import ALIGNMENT

    return (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def run_tune_worker(args) -> dict:
    """The tuner as a bench_train contender would run: same model, store, optimizer and GPU cap."""
    import torch

    import fsdp_speedloader
    from fsdp_speedloader.memory.optimizer_overlap import OptimizersContainer
    from fsdp_speedloader.parallel import maybe_init_process_group

    maybe_init_process_group()
    if torch.cuda.is_available():  # (without CUDA the tuner's CPU stand-in runs: a smoke test of this tool)
        device = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.max_gpu_memory_gib * GIB / total), device)
    ns, Ns = _ints(args.sub_batch_sizes), _ints(args.num_sub_batches)
    start = time.perf_counter()
    options = fsdp_speedloader.SpeedLoaderOptions(offload_params=True, activation_store=args.activation_store,
                                                  param_dtype=torch.bfloat16, forward_prefetch=args.prefetch)
    plan = fsdp_speedloader.tune(
        bench_train.model_config(args), options, seq_len=args.seq_len, gpu_memory_budget_bytes=int(args.max_gpu_memory_gib * GIB),
        max_sub_batch_size=max(ns), max_num_sub_batches=max(Ns),
        build_optimizer=lambda m: OptimizersContainer(
            m, lambda params: torch.optim.AdamW(params, lr=1e-5, fused=True)))  # bench_train's
    wall = time.perf_counter() - start
    print(plan.summary(), file=sys.stderr, flush=True)
    trial = plan.measurements[-1].host_breakdown  # arena = parameter shards + this trial's activation slot
    shards = trial["arena"] - _align(trial["arena_activations"]) if trial["arena"] else 0
    points = {(n, N) for n in ns for N in Ns} | {(plan.sub_batch_size, plan.num_sub_batches)}
    predictions = {f"{n}x{N}": {
        "gpu_bytes": plan.predict_gpu_bytes(n, N), "gpu_reserved_bytes": plan.predict_gpu_reserved_bytes(n, N),
        "host_bytes": plan.predict_host_bytes(n, N),
        "arena_bytes": shards + _align(plan.activation_tokens(n, N, plan.blocks_per_unit)
                                       * plan.activation_bytes_per_token) if shards else None}
        for n, N in sorted(points)}
    return {"plan": plan.as_dict(), "predictions": predictions, "tune_s": wall}


def _run(cmd: list[str], timeout: float) -> tuple[str, dict]:
    """(status, the worker's RESULT record or {'error': ...}); a run refused by the host arena's budget check is
    'host_budget' (the tuner's host line was too generous), not a failure."""
    outcome = harness.launch_worker(cmd, timeout=timeout, cwd=REPO)
    if outcome.ok:
        return "ok", outcome.result
    refused = outcome.status == "failed" and any("pinned host arena needs" in line for line in outcome.output_tail)
    return ("host_budget" if refused else outcome.status), {"error": outcome.error}


def _fit_r2(xs: list[float], ys: list[float]) -> dict:
    import numpy as np

    if len(set(xs)) < 2:
        return {}
    slope, intercept = np.polyfit(xs, ys, 1)
    pred = np.polyval([slope, intercept], xs)
    ss_tot = float(((np.asarray(ys) - np.mean(ys)) ** 2).sum())
    r2 = 1.0 - float(((np.asarray(ys) - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return {"points": len(xs), "intercept_gib": float(intercept), "gib_per_sequence": float(slope), "r2": r2}


def _table(points: list[dict], plan_key: str) -> str:
    def num(value, spec: str) -> str:
        return "" if value is None else format(value, spec)

    lines = ["| n | N | status | tokens/s | tokens/s fwd+bwd | MFU | peak GPU GiB | predicted | error | reserved GiB "
             "| predicted | arena GiB | predicted | host RSS GiB |", "|" + "---|" * 14]
    for p in points:
        status = p["status"] + (" (plan)" if p["key"] == plan_key else "")
        lines.append(" | ".join([
            f"| {p['sub_batch_size']}", str(p["num_sub_batches"]), status, num(p.get("tokens_per_s"), ".0f"),
            num(p.get("tokens_per_s_fwd_bwd"), ".0f"), num(p.get("mfu"), ".1%"), num(p.get("peak_hbm_gib"), ".2f"),
            num(p.get("predicted_gpu_gib"), ".2f"), num(p.get("gpu_error"), "+.1%"),
            num(p.get("peak_hbm_reserved_gib"), ".2f"), num(p.get("predicted_reserved_gib"), ".2f"),
            num(p.get("arena_gib"), ".3f"),
            num(p.get("predicted_arena_gib"), ".3f"), num(p.get("host_peak_rss_gib"), ".1f")]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama2_7b", choices=bench_train.model_names())
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--max-gpu-memory-gib", type=float, default=40.0)
    parser.add_argument("--sub-batch-sizes", default="1,2,4", help="the grid's n values")
    parser.add_argument("--num-sub-batches", default="4,8,16", help="the grid's N values")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per point")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (arena, lazy init)")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--activation-store", default="host")
    parser.add_argument("--target", type=float, default=0.95, help="plan tokens/s over the best point's")
    parser.add_argument("--time-budget-s", type=float, default=420.0, help="the whole sweep, tuner included")
    parser.add_argument("--min-point-s", type=float, default=45.0, help="skip a point with less time left than this")
    parser.add_argument("--timeout", type=float, default=300.0, help="per process")
    parser.add_argument("--name", default=None)
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    parser.add_argument("--tune-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tune_worker:
        harness.print_result(run_tune_worker(args))
        return

    start = time.time()
    remaining = lambda: args.time_budget_s - (time.time() - start)  # noqa: E731
    common = ["--model", args.model, "--layers", str(args.layers), "--seq-len", str(args.seq_len),
              "--max-gpu-memory-gib", str(args.max_gpu_memory_gib), "--prefetch", str(args.prefetch),
              "--activation-store", args.activation_store]
    status, tuner = _run([sys.executable, __file__, "--tune-worker", *common, "--sub-batch-sizes", args.sub_batch_sizes,
                          "--num-sub-batches", args.num_sub_batches], min(args.timeout, remaining()))
    tuner["status"], tuner["wall_s"] = status, time.time() - start
    if status != "ok":
        print(f"tuner: {status}: {tuner['error']}", flush=True)
        plan_key, predictions = None, {}
    else:
        plan = tuner["plan"]
        plan_key = f"{plan['sub_batch_size']}x{plan['num_sub_batches']}"
        predictions = tuner["predictions"]
        print(f"tuner ({tuner['tune_s']:.0f} s, two trial steps): plan {plan_key} (limited by {plan['limited_by']}), "
              f"predicted peak {plan['predicted_gpu_bytes'] / GIB:.2f} GiB allocated, "
              f"{plan['predicted_gpu_reserved_bytes'] / GIB:.2f} GiB reserved", flush=True)

    grid = sorted(((n, N) for n in _ints(args.sub_batch_sizes) for N in _ints(args.num_sub_batches)),
                  key=lambda p: (-p[0] * p[1], -p[0]))
    order = grid if plan_key is None else [tuple(int(v) for v in plan_key.split("x"))] + [
        p for p in grid if f"{p[0]}x{p[1]}" != plan_key]
    bench = [sys.executable, str(TOOLS / "bench_train.py"), *common, "--steps", str(args.steps),
             "--warmup", str(args.warmup)]
    points = []
    for n, N in order:
        key, t0 = f"{n}x{N}", time.time()
        if remaining() < args.min_point_s:
            status, row = "skipped", {"error": f"time budget: {remaining():.0f} s left"}
        else:
            status, row = _run([*bench, "--worker", f"speedloader:{key}"], min(args.timeout, remaining()))
        row.update(key=key, sub_batch_size=n, num_sub_batches=N, status=status, wall_s=time.time() - t0,
                   in_grid=(n, N) in grid)
        pred = predictions.get(key)
        if pred:
            row["predicted_gpu_gib"] = pred["gpu_bytes"] / GIB
            row["predicted_reserved_gib"] = pred["gpu_reserved_bytes"] / GIB
            row["predicted_host_gib"] = pred["host_bytes"] / GIB
            row["predicted_arena_gib"] = pred["arena_bytes"] / GIB if pred["arena_bytes"] else None
        if status == "ok":
            row["arena_gib"] = row.get("exchange", {}).get("arena_bytes", 0) / GIB
            if pred:
                row["gpu_error"] = pred["gpu_bytes"] / GIB / row["peak_hbm_gib"] - 1
        points.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "step_times_s", "exchange")}),
              flush=True)

    ok = [p for p in points if p["status"] == "ok"]
    swept = [p for p in ok if p["in_grid"]]  # the plan is compared with the sweep's best, not with itself
    best = max(swept, key=lambda p: p["tokens_per_s"], default=None)
    planned = next((p for p in ok if p["key"] == plan_key), None)
    comparison = {"plan": plan_key, "best": best["key"] if best else None, "target": args.target,
                  "plan_limited_by": tuner["plan"]["limited_by"] if tuner["status"] == "ok" else None}
    if best and planned:
        comparison.update(plan_tokens_per_s=planned["tokens_per_s"], best_tokens_per_s=best["tokens_per_s"],
                          ratio=planned["tokens_per_s"] / best["tokens_per_s"],
                          ratio_fwd_bwd=planned["tokens_per_s_fwd_bwd"] / max(p["tokens_per_s_fwd_bwd"] for p in swept))
        comparison["target_met"] = comparison["ratio"] >= args.target
    errors = [abs(p["gpu_error"]) for p in ok if "gpu_error" in p]
    comparison["max_abs_gpu_prediction_error"] = max(errors) if errors else None
    # Reserved: the tuner's line is a budget, not an estimate to meet within 5%; and bench_train's peak covers
    # its whole process (initialisation included), the tuner's line one steady step.
    over = [p["peak_hbm_reserved_gib"] / p["predicted_reserved_gib"] - 1 for p in ok
            if p.get("predicted_reserved_gib") and p.get("peak_hbm_reserved_gib")]
    comparison["max_reserved_over_prediction"] = max(over) if over else None
    linearity = {"all": _fit_r2([p["sub_batch_size"] for p in ok], [p["peak_hbm_gib"] for p in ok])}
    for N in _ints(args.num_sub_batches):
        these = [p for p in ok if p["num_sub_batches"] == N and p["in_grid"]]
        linearity[f"N={N}"] = _fit_r2([p["sub_batch_size"] for p in these], [p["peak_hbm_gib"] for p in these])
    if tuner["status"] == "ok":
        linearity["tuner"] = {"intercept_gib": tuner["plan"]["gpu_fit"]["coef"][0] / GIB,
                              "gib_per_sequence": tuner["plan"]["gpu_fit"]["coef"][1] / GIB,
                              "r2": tuner["plan"]["gpu_fit"]["r2"], "points": tuner["plan"]["gpu_fit"]["num_points"]}

    record = {**harness.record_header("sweep_plan", __file__),
              "host_memory_limit_gib": os.environ.get("FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB"),
              "config": {k: v for k, v in vars(args).items() if k != "tune_worker"}, "tuner": tuner,
              "points": points, "comparison": comparison, "linearity": linearity, "wall_s": time.time() - start}
    name = args.name or f"sweep_plan_{args.model}_L{args.layers}_s{args.seq_len}"
    os.makedirs(args.out_dir, exist_ok=True)
    harness.write_record(Path(args.out_dir, f"{name}.json"), record)
    table = _table(points, plan_key)
    lines = [f"# {name}", "", f"`{record['command']}` on {record['device']} (torch {record['torch']}, "
             f"commit {record['commit'][:10]}), {record['wall_s']:.0f} s", ""]
    if comparison.get("ratio") is not None:
        lines.append(f"Plan {plan_key} (tuned in {tuner['tune_s']:.0f} s from two trial steps; limited by "
                     f"{comparison['plan_limited_by']}): {comparison['plan_tokens_per_s']:.0f} tokens/s = "
                     f"{comparison['ratio']:.1%} of the best grid point {comparison['best']} "
                     f"({comparison['best_tokens_per_s']:.0f} tokens/s); target {args.target:.0%}: "
                     f"{'met' if comparison['target_met'] else 'NOT met'}.")
    if errors:
        lines.append(f"Largest |predicted - measured| / measured peak GPU memory: {max(errors):.1%}.")
    if over:
        lines.append(f"Peak reserved GPU memory, measured over predicted (allocator settings: "
                     f"{record['pytorch_cuda_alloc_conf'] or 'defaults'}): at most {max(over) + 1:.1%}.")
    if linearity["all"]:
        lines.append(f"Measured peak GPU memory over the grid: {linearity['all']['intercept_gib']:.2f} GiB + "
                     f"{linearity['all']['gib_per_sequence']:.3f} GiB x n, R^2 = {linearity['all']['r2']:.5f} "
                     f"({linearity['all']['points']} points).")
    lines += ["", table, ""]
    Path(args.out_dir, f"{name}.md").write_text("\n".join(lines))
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
