"""Scaling out with parameters offloaded: weak scaling 1 -> 2 -> 4 GPUs, and 2 nodes over emulated Ethernet.

Every GPU does the same work (the same model, sequence length and n x N sequences per step), so
per-GPU tokens/s stays flat under perfect weak scaling. Cases (each contender runs each case):

  1gpu, 2gpu, 4gpu   one node: ``torchrun --standalone --nproc-per-node G`` on the first G GPUs
  2x2-ethernet       two "nodes" of 2 GPUs on this host (tools/launch_two_nodes.py), NCCL restricted
                     to TCP sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1): every
                     all-gather and reduce-scatter of the 1-D FSDP mesh crosses the emulated network,
                     the paper's setting (ZeRO-3 across nodes)

Contenders: tools/bench_train.py's workers, launched unchanged under torchrun (its ``--worker`` CLI;
one RESULT line per rank, kept apart with torchrun's ``--log-dir``): ``speedloader``, ``fsdp2-offload``
and ``deepspeed-offload`` (ZeRO-3, parameters and DeepSpeedCPUAdam on the host, micro-batch n, N
accumulation steps; tools/bench_deepspeed.py), the last only when deepspeed is installed; on request also
``speedloader-overlap`` (each unit's CPU AdamW step overlapped with the backward). A contender
may carry bench_train's options after its name (``speedloader:compile:root=device``,
``fsdp2-offload:compile``); the targets compare each contender's fastest variant.
Over a link of known bandwidth (issue 43): ``--link-gbit G`` runs the two-node case with each node in its own
network namespace, joined by a veth pair shaped to G Gbit/s each way (tools/slow_link.py; ``--link-delay-ms``,
``--link-modes`` as in tools/launch_two_nodes.py); NCCL uses its socket transport between the nodes and
NVLink within one. The link is built once for the whole invocation; the record says which
(``link``) and each run how many bytes crossed it (``link_bytes_sent``, per direction; per step and in seconds at
the link's rate: ``link_bytes_per_step``, ``link_s_per_step``). ``targets.ethernet_bound`` bounds each ratio from
the measured runs: at most the peer's step over layer-major's forward+backward, with each side's link share.
``--dp-replicate 2`` gives the two-node case an HSDP mesh (one replica per node: only gradients cross the link;
DeepSpeed's ZeRO-3 has no such mesh and shards over both nodes); the one-node cases stay 1-D.
Every rank gets the same number of CPU threads (``--threads-per-rank``, default cores / largest
case), also in the 1-GPU case, so that the offloaded optimizer step is not what scales.

One invocation stays within ``--budget-s`` (runs that no longer fit are recorded as skipped, in
priority order: speedloader, fsdp2-offload, deepspeed-offload; per contender 1gpu, 4gpu,
2x2-ethernet, 2gpu). Writes bench/results/<name>.json after every run (device, torch version,
commit, command, configuration, every rank's figures, the aggregates, the targets) and, at the
end, bench/results/<name>.png.

    python tools/bench_scale.py                                  # the 4-GPU machine, < 10 minutes
    python tools/bench_scale.py --dry-run --gpu-ids 0,1,2,3      # print every launch, run nothing
    python tools/bench_scale.py --plot-only bench/results/scale_llama2_7b_L4_s4096_1x8.json [more.json ...]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))  # tools/ is not a package: its modules import by name
import harness  # noqa: E402
import launch_two_nodes  # noqa: E402
import protocol  # noqa: E402
import slow_link  # noqa: E402
from bench_train import contender_env, parse_contender  # noqa: E402

REPO = harness.REPO

BENCH_TRAIN = TOOLS / "bench_train.py"
CONTENDERS = ("speedloader", "fsdp2-offload", "deepspeed-offload")  # the default set
# Also accepted: the layer-major engine with each unit's CPU optimizer step overlapped with the backward.
MORE_CONTENDERS = ("speedloader-overlap",)
CASE_ORDER = ("1gpu", "4gpu", "2x2-ethernet", "2gpu")  # the priority within a contender
MIN_RUN_S = 60.0  # a run is not started with less budget than this left


def split_contender(spec: str) -> tuple[str, str]:
    """'NAME[:option...]' -> (NAME, ':option...'): bench_train's options, which follow the shape there."""
    name, _, options = spec.partition(":")
    return name, f":{options}" if options else ""


def family(spec: str) -> str:
    """'speedloader' for every layer-major contender (plain or overlapped), else the contender's name."""
    name = split_contender(spec)[0]
    return "speedloader" if name.startswith("speedloader") else name


def contender_shape(spec: str, shape: str) -> tuple[str, str]:
    """(the contender's n x N, its other options). A contender may name its own micro-batch as its first
    option (``fsdp2-offload:8x8:compile``) with the same n * N sequences per GPU as ``--shape``: the same
    effective batch, split its own way."""
    options = split_contender(spec)[1].split(":")[1:]
    if options and re.fullmatch(r"\d+x\d+", options[0]):
        own, options = options[0], options[1:]
        n, count = (int(v) for v in own.split("x"))
        base_n, base_count = (int(v) for v in shape.split("x"))
        if n < 1 or count < 1 or n * count != base_n * base_count:
            raise ValueError(f"contender {spec!r}: {own} is {n * count} sequences per GPU per step, --shape {shape} "
                             f"is {base_n * base_count}; give a split of the same effective batch (n x N = "
                             f"{base_n * base_count})")
        shape = own
    return shape, "".join(f":{o}" for o in options)


def worker_spec(contender: str, shape: str) -> str:
    """bench_train's ``--worker`` value: 'NAME:nxN[:option...]'."""
    own_shape, options = contender_shape(contender, shape)
    return f"{split_contender(contender)[0]}:{own_shape}{options}"


@dataclass(frozen=True)
class Case:
    name: str
    nodes: int
    gpus_per_node: int
    emulate_ethernet: bool = False

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def build_cases(gpus: Sequence[int], ethernet: Optional[str]) -> list[Case]:
    cases = [Case(f"{g}gpu", 1, g) for g in gpus]
    if ethernet:
        nodes, per_node = (int(v) for v in ethernet.split("x"))
        if nodes != 2:
            raise ValueError(f"--ethernet {ethernet}: only 2 emulated nodes are supported (2xG)")
        cases.append(Case(f"{nodes}x{per_node}-ethernet", nodes, per_node, emulate_ethernet=True))
    return cases


def run_order(contenders: Sequence[str], cases: Sequence[Case]) -> list[tuple[str, Case]]:
    """Every (contender, case), most important first: what a cut-short budget drops is the least needed."""
    def case_rank(case: Case) -> int:
        key = "2x2-ethernet" if case.emulate_ethernet else case.name
        return CASE_ORDER.index(key) if key in CASE_ORDER else len(CASE_ORDER)

    return [(c, case) for c in contenders for case in sorted(cases, key=case_rank)]


def worker_args(args: argparse.Namespace, contender: str, case: Optional[Case] = None) -> list[str]:
    """One rank's command line: tools/bench_train.py's ``--worker`` CLI (HSDP for a two-node case with
    ``--dp-replicate``)."""
    hsdp = case is not None and case.nodes > 1 and args.dp_replicate > 1
    return [str(args.worker_script or BENCH_TRAIN), "--worker", worker_spec(contender, args.shape), "--model", args.model,
            "--layers", str(args.layers), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--peak-tflops", str(args.peak_tflops), "--prefetch", str(args.prefetch),
            "--activation-store", args.activation_store, "--device", args.device,
            *(["--max-gpu-memory-gib", str(args.max_gpu_memory_gib)] if args.max_gpu_memory_gib else []),
            *(["--dp-replicate", str(args.dp_replicate)] if hsdp else []),
            *(["--profile"] if args.profile else [])]


def case_launch(case: Case, script: Sequence[str], *, device: str, gpu_ids: Sequence[str], base_env: dict,
                threads_per_rank: int, log_dir: Path, python: str = sys.executable,
                link: Optional[slow_link.Link] = None) -> tuple[list, list]:
    """(commands, environments) of the torchrun agent(s) of one run; each rank's stdout in log_dir/node<i>. A
    two-node case goes over ``link`` where given (NVLink within a node, the link between them), else over
    loopback with NCCL restricted to TCP sockets."""
    env = dict(base_env, OMP_NUM_THREADS=str(threads_per_rank))
    if case.nodes == 1:
        cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(case.gpus_per_node),
               "--log-dir", str(log_dir / "node0"), "--redirects", "1", *script]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids[: case.gpus_per_node]) if device == "cuda" else ""
        return [cmd], [env]
    return launch_two_nodes.two_node_launch(
        script, device=device, nproc_per_node=case.gpus_per_node, base_env=env,
        emulate_ethernet=case.emulate_ethernet and link is None, link=link,
        gpus=list(gpu_ids) if device == "cuda" else None, rdzv_id=f"bench-scale-{uuid.uuid4().hex[:8]}", python=python,
        extra_args=[["--log-dir", str(log_dir / f"node{node}"), "--redirects", "1"] for node in range(case.nodes)])


def collect_rank_results(log_dir: Path) -> list[dict]:
    """Every rank's RESULT line, from torchrun's per-rank stdout files under ``log_dir`` (a line still being
    written, or cut short, does not count)."""
    results = []
    for path in sorted(glob.glob(str(log_dir / "**" / "stdout.log"), recursive=True)):
        try:
            result = harness.parse_result(Path(path).read_text(errors="replace"))
        except ValueError:
            continue
        if result is not None:
            results.append(result)
    return results


def aggregate(ranks: Sequence[dict]) -> dict:
    """The run's figures: ranks step in lockstep, so the slowest rank's time is the step time."""
    world = len(ranks)
    step_s = max(r["step_s"] for r in ranks)
    fwd_bwd_s = max(r["fwd_bwd_s"] for r in ranks)
    tokens = sum(r["tokens_per_step"] for r in ranks)
    return {"world_size": world, "tokens_per_step": tokens, "step_s": step_s, "fwd_bwd_s": fwd_bwd_s,
            "optimizer_s": max(r["optimizer_s"] for r in ranks),
            "tokens_per_s": tokens / step_s, "tokens_per_s_per_gpu": tokens / step_s / world,
            "tokens_per_s_fwd_bwd": tokens / fwd_bwd_s, "tokens_per_s_fwd_bwd_per_gpu": tokens / fwd_bwd_s / world,
            # Each rank's MFU over its own step time, re-timed to the slowest rank's: the MFU per GPU of the run.
            "mfu": statistics.mean(r["mfu"] * r["step_s"] / step_s for r in ranks) if "mfu" in ranks[0] else None,
            "peak_hbm_gib": max(r.get("peak_hbm_gib", 0.0) for r in ranks),
            "host_peak_rss_gib_per_rank": max(r.get("host_peak_rss_gib", 0.0) for r in ranks)}


def run_dir_name(contender: str, case: Case) -> str:
    return re.sub(r"[^\w.-]", "_", f"{contender}_{case.name}")  # options' ':' and '=' out of paths


def run_case(contender: str, case: Case, args: argparse.Namespace, work_dir: Path, timeout_s: float,
             link: Optional[slow_link.Link] = None) -> dict:
    """Launches one run and returns its record (status, every rank's figures, the aggregate)."""
    log_dir = work_dir / run_dir_name(contender, case)
    script = worker_args(args, contender, case)
    link = link if case.nodes > 1 else None
    commands, envs = case_launch(case, script, device=args.device, gpu_ids=args.gpu_ids,
                                 base_env=contender_env(contender),
                                 threads_per_rank=args.threads_per_rank, log_dir=log_dir, link=link)
    record = {"contender": contender, "case": case.name, "nodes": case.nodes, "gpus_per_node": case.gpus_per_node,
              "world_size": case.world_size, "emulated_ethernet": case.emulate_ethernet,
              "commands": [shlex.join(c) for c in commands],
              "nccl_env": {k: v for k, v in envs[0].items() if k.startswith("NCCL_")},
              "omp_num_threads": args.threads_per_rank, "over_link": link is not None}
    log_dir.mkdir(parents=True, exist_ok=True)
    console = log_dir / "console.log"
    start = time.monotonic()
    sent_before = link.bytes_sent() if link else None
    with open(console, "w") as sink:
        # Once every rank has printed its RESULT, a hang at exit (NCCL teardown) costs 60 s at most.
        codes = launch_two_nodes.run_agents(
            commands, envs, timeout_s=timeout_s, grace_s=60.0, sink=sink,
            done=lambda: len(collect_rank_results(log_dir)) == case.world_size)
    record["wall_s"] = time.monotonic() - start
    if link:  # the whole run's traffic, setup included: that the bytes crossed the link, and how many
        record["link_bytes_sent"] = [None if a is None or b is None else b - a
                                     for a, b in zip(sent_before, link.bytes_sent())]
        record.update(link_per_step(record["link_bytes_sent"], args.steps + args.warmup,
                                    link.gbit if link.mode == "netns" else None))
    ranks = collect_rank_results(log_dir)
    record["returncodes"] = codes
    if len(ranks) == case.world_size:  # every rank measured: the figures stand, whatever the exit
        record.update(status="ok", ranks=ranks, **aggregate(ranks))
    else:  # the first agent that failed, else None if one was stopped (harness: oom, timeout or failed)
        failed = [code for code in codes if code not in (0, None)]
        code = failed[0] if failed else (None if None in codes else 0)
        done = harness.Finished(code, console.read_text(errors="replace"), "", record["wall_s"], timeout=timeout_s)
        status, error = done.failure(f"with {len(ranks)} of {case.world_size} ranks reported")
        record.update(status=status, ranks=ranks, error=error)
    return record


# ---------------------------------------------------------------------------------------------
# Targets, table, plot
# ---------------------------------------------------------------------------------------------


def link_per_step(sent: Sequence[Optional[int]], steps: int, gbit: Optional[float]) -> dict:
    """The busier direction's bytes per step (warm-up steps counted; the start-up's few bytes too, so a little
    high) and, over a link of ``gbit`` each way (netns mode; None: no rate, or one shared by both directions),
    the seconds they take at that rate: the least time a step spends on the link."""
    counted = [b for b in sent if b is not None]
    if not counted or steps < 1:
        return {}
    per_step = max(counted) / steps
    return {"link_bytes_per_step": per_step,
            "link_s_per_step": per_step * 8 / (gbit * 1e9) if gbit else None}


# Each taken as its median over a (contender, case)'s invocations: the rates, and the times the bound is made of.
MEDIANS = ("tokens_per_s", "tokens_per_s_per_gpu", "step_s", "fwd_bwd_s", "link_bytes_per_step", "link_s_per_step")


def medians(results: Sequence[dict]) -> dict:
    """{(contender, case): its median invocation}: each ok run's rates and times (``MEDIANS``) replaced by their
    median over the invocations of that (contender, case), with their spread (``protocol.spread`` of tokens/s)
    under ``spread``."""
    runs: dict = {}
    for r in results:
        if r.get("status") == "ok":
            runs.setdefault((r["contender"], r["case"]), []).append(r)
    out = {}
    for key, rs in runs.items():
        out[key] = {**rs[0], **{k: statistics.median(r[k] for r in rs) for k in MEDIANS
                                if all(r.get(k) is not None for r in rs)},
                    "spread": protocol.spread(r["tokens_per_s"] for r in rs)}
    return out


def paired_ratio(results: Sequence[dict], ours: tuple[str, str], theirs: tuple[str, str]) -> dict:
    """``ours`` over ``theirs`` (each a contender and its case): :func:`protocol.paired_ratio` of their runs, median
    over median of the invocations both ran in, flagged ``separate_invocations`` where fewer than the protocol's
    minimum are shared. Runs without an invocation number (older records) count as one group."""
    def runs(contender: str, case: str) -> list[dict]:
        return [r for r in results if r.get("status") == "ok" and r["contender"] == contender and r["case"] == case]

    mine, other = runs(*ours), runs(*theirs)
    if any(r.get("invocation") is None for r in (*mine, *other)):
        return {"ratio": statistics.median(r["tokens_per_s"] for r in mine)
                / statistics.median(r["tokens_per_s"] for r in other), "invocations": None,
                "separate_invocations": False}
    pair = protocol.paired_ratio({r["invocation"]: r["tokens_per_s"] for r in mine},
                                 {r["invocation"]: r["tokens_per_s"] for r in other})
    shared = pair["invocations"] if pair["invocations"] is not None else sorted(r["invocation"] for r in mine)
    return {"ratio": pair["ratio"], "invocations": shared, "separate_invocations": pair["separate_invocations"]}


def ethernet_bound(speedloader: dict, peer: dict) -> dict:
    """How far the ratio over ``peer`` could go, from the measured runs: layer-major's step is no shorter than its
    forward+backward, so against the peer as measured the ratio is at most the peer's step over that; and what
    share of each step the link alone needs at its rate (about 1: bound by the link)."""
    out = {"peer_step_s": peer.get("step_s"), "speedloader_fwd_bwd_s": speedloader.get("fwd_bwd_s"),
           "at_most": None, "peer_link_share": None, "speedloader_link_share": None}
    if out["peer_step_s"] and out["speedloader_fwd_bwd_s"]:
        out["at_most"] = out["peer_step_s"] / out["speedloader_fwd_bwd_s"]
    for key, run in (("peer_link_share", peer), ("speedloader_link_share", speedloader)):
        if run.get("link_s_per_step") and run.get("step_s"):
            out[key] = run["link_s_per_step"] / run["step_s"]
    return out


def targets(results: Sequence[dict]) -> dict:
    """The issue's targets from the measured runs (None where a run is missing). Weak scaling per contender
    as given (with its options); over Ethernet, each contender's fastest variant (``ethernet_variants``)."""
    ok = medians(results)
    out: dict = {"weak_scaling_per_gpu_4_over_1": {}, "ethernet_speedloader_over": {}, "ethernet_variants": {},
                 "repeats": {f"{c} {case}": r["spread"] for (c, case), r in ok.items()}}
    for contender in dict.fromkeys([*CONTENDERS, *(r["contender"] for r in results)]):
        one, four = ok.get((contender, "1gpu")), ok.get((contender, "4gpu"))
        out["weak_scaling_per_gpu_4_over_1"][contender] = (
            four["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"] if one and four else None)
    fastest: dict = {}
    for (contender, case), r in ok.items():
        name = family(contender)
        if case.endswith("-ethernet") and (name not in fastest or r["tokens_per_s"] > fastest[name]["tokens_per_s"]):
            fastest[name] = r
    out["ethernet_variants"] = {name: r["contender"] for name, r in fastest.items()}
    if "speedloader" in fastest:
        best = fastest["speedloader"]

        def over(peer: dict) -> dict:
            return paired_ratio(results, (best["contender"], best["case"]), (peer["contender"], peer["case"]))

        out["ethernet_pairs"] = {name: over(fastest[name]) for name in CONTENDERS[1:] if name in fastest}
        out["ethernet_speedloader_over"] = {name: pair["ratio"] for name, pair in out["ethernet_pairs"].items()}
        # Against every variant too (e.g. each micro-batch of the same effective batch), not only the fastest.
        out["ethernet_speedloader_over_each"] = {
            contender: over(r)["ratio"] for (contender, case), r in ok.items()
            if case.endswith("-ethernet") and family(contender) != "speedloader"}
        out["ethernet_bound"] = {name: ethernet_bound(fastest["speedloader"], fastest[name])
                                 for name in CONTENDERS[1:] if name in fastest}
    # DeepSpeed runs eager: the protocol's like-for-like ratio is layer-major's fastest eager variant over it.
    eager = [r for (contender, case), r in ok.items() if case.endswith("-ethernet")
             and family(contender) == "speedloader" and "compile" not in contender.split(":")[1:]]
    if eager and "deepspeed-offload" in fastest:
        best_eager = max(eager, key=lambda r: r["tokens_per_s"])
        peer = fastest["deepspeed-offload"]
        out["ethernet_eager_speedloader_over_deepspeed"] = {
            "speedloader": best_eager["contender"], "deepspeed-offload": peer["contender"],
            **paired_ratio(results, (best_eager["contender"], best_eager["case"]), (peer["contender"], peer["case"]))}
    out["goals"] = {"weak_scaling_per_gpu_4_over_1 (speedloader)": ">= 0.95 (issue 43; 8 GPUs: >= 0.93)",
                    "ethernet_speedloader_over fsdp2-offload": ">= 4 over 10 Gbit/s, each at its best micro-batch",
                    "ethernet_speedloader_over deepspeed-offload": ">= 4 over 10 Gbit/s, each at its best micro-batch"}
    return out


def markdown(results: Sequence[dict]) -> str:
    lines = ["| contender | case | GPUs | status | tokens/s | tokens/s per GPU | fwd+bwd tokens/s per GPU | step s "
             "| optimizer s | peak HBM GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("status") == "ok":
            lines.append(f"| {r['contender']} | {r['case']} | {r['world_size']} | ok | {r['tokens_per_s']:,.0f} | "
                         f"{r['tokens_per_s_per_gpu']:,.0f} | {r['tokens_per_s_fwd_bwd_per_gpu']:,.0f} | "
                         f"{r['step_s']:.2f} | {r['optimizer_s']:.2f} | {r['peak_hbm_gib']:.1f} |")
        else:
            lines.append(f"| {r['contender']} | {r['case']} | {r['world_size']} | {r.get('status')} | "
                         f"{(r.get('error') or '')[:90]} | | | | | |")
    return "\n".join(lines)


def _micro_batch(run: dict) -> str:
    """'n x N, peak HBM' of a run, from its ranks' own records (its contender may name its own micro-batch)."""
    ranks = run.get("ranks") or []
    if not ranks or "sub_batch_size" not in ranks[0]:
        return ""
    shape = f"{ranks[0]['sub_batch_size']} x {ranks[0]['num_sub_batches']}"
    return f"{shape}, {run['peak_hbm_gib']:.1f} GiB" if "peak_hbm_gib" in run else shape


def plot(record: dict, path: Path) -> Optional[Path]:
    plt = harness.pyplot("bench_scale")
    if plt is None:
        return None
    ok = [r for r in record["results"] if r.get("status") == "ok"]
    weak = [r for r in ok if not r["emulated_ethernet"]]
    eth = [r for r in record["results"] if r.get("emulated_ethernet") or str(r.get("case", "")).endswith("-ethernet")]
    panels = int(bool(weak)) + int(bool(eth)) or 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, max(4.0, 1.2 + 0.45 * len(eth))), squeeze=False)
    axes = list(axes[0])
    if weak:
        left = axes.pop(0)
        for i, contender in enumerate(dict.fromkeys(r["contender"] for r in weak)):
            points = sorted((r["world_size"], r["tokens_per_s_per_gpu"]) for r in weak if r["contender"] == contender)
            left.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=f"C{i}", label=contender)
            left.axhline(points[0][1], color=f"C{i}", linestyle=":", linewidth=0.8)
        left.set_xlabel("GPUs of one node")
        left.set_ylabel("tokens/s per GPU")
        left.set_title("weak scaling, parameters offloaded (dotted: 1-GPU level)")
        left.set_xticks(sorted({r["world_size"] for r in weak}))
        left.set_ylim(bottom=0)
        left.legend(fontsize=8)
    if eth:  # one horizontal bar per run: any number of variants stays readable; failed runs named, not drawn
        right = axes.pop(0)
        base = max((r["tokens_per_s"] for r in eth if r.get("status") == "ok"
                    and family(r["contender"]) == "speedloader"), default=None)
        names = list(dict.fromkeys(split_contender(r["contender"])[0] for r in eth))
        rows = eth[::-1]  # the first run on top
        values = [r["tokens_per_s_per_gpu"] if r.get("status") == "ok" else 0.0 for r in rows]
        labels = [f"{r['contender']}\n{_micro_batch(r)}" for r in rows]
        right.barh(range(len(rows)), values, color=[f"C{names.index(split_contender(r['contender'])[0])}" for r in rows])
        right.set_yticks(range(len(rows)), labels, fontsize=7)
        for y, (r, value) in enumerate(zip(rows, values)):
            if r.get("status") != "ok":
                text = f" {r.get('status')}"
            else:
                text = f" {value:,.0f}"
                if base and family(r["contender"]) != "speedloader":
                    text += f"  (speedloader {base / r['tokens_per_s']:.2f}x)"
            right.annotate(text, (value, y), va="center", fontsize=7)
        right.set_xlim(0, 1.45 * max(values + [1.0]))
        right.set_xlabel("tokens/s per GPU")
        link = record.get("link")
        over = (f"a {link['gbit']:g} Gbit/s link ({link['mode']})" if link and link.get("gbit")
                else f"a link ({link['mode']})" if link else "TCP sockets")
        mesh = "HSDP, " if record["config"].get("dp_replicate", 1) > 1 else ""
        right.set_title(f"{eth[0]['nodes']} nodes x {eth[0]['gpus_per_node']} GPUs, {mesh}NCCL\nover {over}"
                        if "nodes" in eth[0] else "emulated Ethernet", fontsize=10)
    cfg = record["config"]
    cap = f", GPU memory capped at {cfg['max_gpu_memory_gib']:g} GiB" if cfg.get("max_gpu_memory_gib") else ""
    fig.suptitle(f"{cfg['model']} x {cfg['layers']} layers, seq {cfg['seq_len']}, n x N = {cfg['shape']} per GPU "
                 f"unless named,\n{record['device']}{cap}", fontsize=10)
    return harness.save_figure(fig, path)


# What may differ between the commands that append to one record: the budget, limits and where it is written, and
# which contenders run (a peer whose steps over a slow link fill a command runs in a command of its own; the
# record's contenders are then all that any of its commands ran).
RESUME_FREE = ("budget_s", "timeout", "invocations", "out_dir", "name", "dry_run")
MERGED = ("contenders",)


def resumed(record: dict, path: Path) -> dict:
    """``record``, or the one already at ``path`` when it measured the same work on the same machine kind: its
    results kept, this command appended (the next invocations continue its numbering), its contenders joined to the
    record's. Anything else is refused."""
    if not path.is_file():
        return {**record, "commands": [{k: record[k] for k in ("command", "commit", "timestamp")}]}
    old = json.loads(path.read_text())
    mine = {k: v for k, v in record["config"].items() if k not in RESUME_FREE + MERGED}
    theirs = {k: v for k, v in old["config"].items() if k not in RESUME_FREE + MERGED}
    if old["device"] != record["device"] or mine != theirs:
        diff = sorted(k for k in {*mine, *theirs} if mine.get(k) != theirs.get(k))
        raise SystemExit(f"{path} holds another measurement (device {old['device']!r}, settings {diff} differ): "
                         "use another --name or --out-dir")
    old.setdefault("commands", []).append({k: record[k] for k in ("command", "commit", "timestamp")})
    joined = [c for spec in (old["config"]["contenders"], record["config"]["contenders"]) for c in spec.split(",") if c]
    old["config"]["contenders"] = ",".join(dict.fromkeys(joined))
    return old


def _gpu_ids(device: str, given: Optional[str]) -> list[str]:
    if device != "cuda":
        return []
    if given:
        return given.split(",")
    try:
        return launch_two_nodes.visible_gpus(dict(os.environ))
    except Exception:  # no torch CUDA here: a dry run on a CPU machine names --gpu-ids
        return []


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama2_7b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--shape", default="1x8", help="n x N per GPU: sub-batch (micro-batch) size x their number")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help="comma-separated; NAME[:option...] with bench_train's options, e.g. speedloader:compile:root=device")
    parser.add_argument("--gpus", default="1,2,4", help="weak-scaling cases: GPUs of one node")
    parser.add_argument("--ethernet", default="2x2", help="NODESxGPUS over emulated Ethernet ('' to leave out)")
    parser.add_argument("--dp-replicate", type=int, default=1,
                        help="the two-node case's mesh: 2 = HSDP, one replica per node (one-node cases stay 1-D)")
    parser.add_argument("--link-gbit", type=float, default=None,
                        help="the two-node case over a link of this rate, Gbit/s each way (tools/slow_link.py)")
    parser.add_argument("--link-delay-ms", type=float, default=0.0)
    parser.add_argument("--link-modes", default="netns", help=f"slow_link modes to try, in order ({slow_link.MODES})")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--activation-store", default="host")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--max-gpu-memory-gib", type=float, default=None,
                        help="every rank's GPU memory cap (the same for every contender: a larger micro-batch "
                             "that does not fit is recorded as oom)")
    parser.add_argument("--threads-per-rank", type=int, default=None,
                        help="OMP_NUM_THREADS of every rank (default: CPU cores / the largest case's ranks)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the whole invocation")
    parser.add_argument("--profile", action="store_true",
                        help="every rank traces one more step after the timed ones (bench_train's --profile): its "
                             "stream busy times, copies, collectives among the top kernels, launch gaps, in the record")
    parser.add_argument("--invocations", type=int, default=1,
                        help="repeat every run this many times, the order reversed every other time (the protocol: "
                             "3, over one or more commands appending to the same record)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per run")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--gpu-ids", default=None, help="GPUs to use, e.g. 0,1,2,3 (default: every visible one)")
    parser.add_argument("--name", default=None)
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    parser.add_argument("--dry-run", action="store_true", help="print every launch; run nothing")
    parser.add_argument("--plot-only", nargs="+", default=None,
                        help="re-plot JSON record(s); several are merged into <first>_merged.json/.png")
    parser.add_argument("--worker-script", default=None, help=argparse.SUPPRESS)  # tests: a stand-in worker
    args = parser.parse_args(argv)

    if args.plot_only:  # one record, or several (e.g. a separate deepspeed-offload run) merged into one
        paths = [Path(p) for p in args.plot_only]
        record = json.loads(paths[0].read_text())
        out = paths[0].with_suffix(".png")
        if len(paths) > 1:
            for extra in paths[1:]:
                record["results"] += json.loads(extra.read_text())["results"]
            record["targets"] = targets(record["results"])
            record["merged_from"] = [str(p) for p in paths]
            out = paths[0].with_name(paths[0].stem + "_merged.png")
            harness.write_record(out.with_suffix(".json"), record)
        print(markdown(record["results"]))
        print(json.dumps(record["targets"], indent=2))
        print(plot(record, out))
        return 0

    contenders = [c for c in args.contenders.split(",") if c]
    unknown = sorted({split_contender(c)[0] for c in contenders} - {*CONTENDERS, *MORE_CONTENDERS})
    if unknown:
        parser.error(f"unknown contender(s) {unknown}; choose from {', '.join(CONTENDERS + MORE_CONTENDERS)}")
    for contender in contenders:  # the shape's and bench_train's own checks of the options, before any launch
        try:
            parse_contender(worker_spec(contender, args.shape), None)
        except ValueError as err:
            parser.error(str(err))
    cases = build_cases([int(g) for g in args.gpus.split(",") if g], args.ethernet or None)
    modes = [m for m in args.link_modes.split(",") if m]
    if args.link_gbit is not None and (args.link_gbit <= 0 or args.link_delay_ms < 0 or not modes
                                       or set(modes) - set(slow_link.MODES) or not args.ethernet):
        parser.error(f"--link-gbit {args.link_gbit} --link-delay-ms {args.link_delay_ms} --link-modes "
                     f"{args.link_modes} --ethernet {args.ethernet!r}: give a positive rate, a delay >= 0, modes of "
                     f"{','.join(slow_link.MODES)} and a two-node case (--ethernet 2xG)")
    if args.dp_replicate not in (1, 2) or (args.dp_replicate == 2 and not args.ethernet):
        parser.error(f"--dp-replicate {args.dp_replicate}: 1 (FSDP over all ranks) or 2 (HSDP, one replica per "
                     "node of the two-node case, --ethernet 2xG)")
    args.gpu_ids = _gpu_ids(args.device, args.gpu_ids)
    largest = max(c.world_size for c in cases)
    if args.device == "cuda" and not args.dry_run and len(args.gpu_ids) < largest:
        parser.error(f"the largest case needs {largest} GPUs, {len(args.gpu_ids)} visible")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    args.threads_per_rank = args.threads_per_rank or max(1, cores // largest)
    name = args.name or f"scale_{args.model}_L{args.layers}_s{args.seq_len}_{args.shape}"
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None

    if args.dry_run:
        with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
            link = (slow_link.plan_link(modes[0], args.link_gbit, args.link_delay_ms)
                    if args.link_gbit is not None else None)
            for contender, case in run_order(contenders, cases):
                commands, envs = case_launch(case, worker_args(args, contender, case), device=args.device,
                                             gpu_ids=args.gpu_ids, base_env=contender_env(contender),
                                             threads_per_rank=args.threads_per_rank,
                                             log_dir=Path(tmp) / run_dir_name(contender, case),
                                             link=link if case.nodes > 1 else None)
                for node, (cmd, env) in enumerate(zip(commands, envs)):
                    changed = " ".join(f"{k}={v}" for k, v in sorted(env.items()) if os.environ.get(k) != v)
                    print(f"[{contender} {case.name} node{node}] {changed} {shlex.join(cmd)}")
        return 0

    # The GPU's name from a throw-away process: no CUDA context in this one while the runs use the GPUs.
    device = harness.device_name(args.device)
    record = {**harness.record_header("scale", __file__, argv, device=f"{len(args.gpu_ids)} x {device}"
                                      if args.device == "cuda" else device),
              "config": {k: v for k, v in vars(args).items() if k not in ("worker_script", "plot_only")},
              "results": []}
    out_dir = Path(args.out_dir)
    record = resumed(record, out_dir / f"{name}.json")
    first = 1 + max((r.get("invocation", 0) for r in record["results"]), default=-1)
    with contextlib.ExitStack() as stack:  # the link, when asked for: built once, removed after the last run
        link = None
        if args.link_gbit is not None:
            try:
                link = stack.enter_context(slow_link.open_link(args.link_gbit, args.link_delay_ms, modes))
            except slow_link.LinkUnavailable as err:
                print(f"bench_scale: {err}\n  (--link-modes netns,lo,sockets allows the fallbacks; tools/slow_link.py "
                      "says what each means)", file=sys.stderr)
                return 2
            record["link"] = link.describe()
            print(f"bench_scale: link {record['link']['mode']}: {record['link']['meaning']}", flush=True)
        start = time.monotonic()
        runs = [(i, contender, case) for i in range(first, first + args.invocations)
                for contender, case in protocol.run_order(run_order(contenders, cases), i)]
        with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
            for invocation, contender, case in runs:
                left = args.budget_s - (time.monotonic() - start)
                no_deepspeed = not has_deepspeed and args.worker_script is None
                if split_contender(contender)[0] == "deepspeed-offload" and no_deepspeed:
                    result = {"contender": contender, "case": case.name, "world_size": case.world_size,
                              "status": "skipped", "error": "deepspeed is not installed"}
                elif left < MIN_RUN_S:
                    result = {"contender": contender, "case": case.name, "world_size": case.world_size,
                              "status": "skipped",
                              "error": f"budget: {left:.0f} s of --budget-s {args.budget_s:.0f} left"}
                else:
                    print(f"bench_scale: [{invocation}] {contender} {case.name} ...", end=" ", flush=True)
                    # each invocation its own log directories: a rank's result file is never read twice
                    result = run_case(contender, case, args, Path(tmp, f"invocation{invocation}"),
                                      timeout_s=min(args.timeout, left),
                                      link=link)
                    print(result["status"] + (f", {result['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU "
                                              f"({result['wall_s']:.0f} s)" if result["status"] == "ok" else
                                              f": {result.get('error', '')[:300]}"), flush=True)
                record["results"].append({**result, "invocation": invocation})
                record["targets"] = targets(record["results"])
                harness.write_record(out_dir / f"{name}.json", record)  # after every run
    print("\n" + markdown(record["results"]))
    print(json.dumps(record["targets"], indent=2))
    png = plot(record, out_dir / f"{name}.png")
    print(f"bench_scale: wrote {out_dir / f'{name}.json'}" + (f", {png}" if png else ""))
    return 0 if any(r.get("status") == "ok" for r in record["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
