"""Host memory of one rank: by tier and mode (bytes per parameter), and the arena against PyTorch's pinning.

Computed from the model's parameter shapes on the meta device (no GPU, nothing allocated).

Modes (``fsdp_speedloader/memory/host_plan.py``; activations per ``--activation-store``):

  exact-fp32       fp32 shards, a gradient slot per parameter, fp32 AdamW moments: the plain optimizer, or the
                   overlapped one with exact clipping (optim.grad_clip > 0: the gradients outlive the backward)
  in-flight-grads  the same, but gradient slots for optim.grad_slots_in_flight units (R, reused in turn): the
                   overlapped optimizer without clipping (optim.overlap_with_backward=true optim.grad_clip=0); exact
  bf16-states      in-flight gradients and bf16 moments (optim.state_dtype=bf16)
  int8-states      in-flight gradients and 8-bit blockwise moments (optim.state_dtype=int8)
  bf16-master-int8 the same with bf16 master weights (optim.master_dtype=bf16: 2-byte shards and gradients,
                   stochastic rounding; not exact)

For each it prints bytes per parameter by tier, the total, whether it fits ``--host-gib`` (default 128: the
arena's budget, less its 10% margin and ``--host-overhead-gib`` for the process itself), and the largest model of the
same shape family that fits (the per-parameter tiers scale with the model, the in-flight gradient regions with one
unit, the activations with the depth).

The older comparison stays: PyTorch's pinning (CPUOffloadPolicy(pin_memory=True) pins each padded fp32 shard
separately, and each reduce-scattered gradient takes a fresh page-locked block per step, both rounded to a power of
two by the caching host allocator) against the arena's exact slots.

Usage:
  python tools/arena_report.py                                     # llama2_7b, llama2_13b, qwen3_14b
  python tools/arena_report.py --models llama2_7b --world-size 8 --num-sub-batches 16
  python tools/arena_report.py --models llama2_7b --measure --layers 4   # GPU: also measure both pinnings

Writes bench/results/arena_report_<model>_w<world>.json per model (device, torch, commit, command, config, figures).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
import harness  # noqa: E402

REPO = harness.REPO
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from fsdp_speedloader.app.config import OptimConfig  # noqa: E402
from fsdp_speedloader.memory.arena import ALIGNMENT  # noqa: E402

GIB = float(1 << 30)


def pow2(n: int) -> int:
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def model_config(name: str, layers: int | None):
    import yaml

    from fsdp_speedloader.app.config import ModelConfig

    with open(REPO / "conf" / "model" / f"{name}.yaml") as f:
        fields = yaml.safe_load(f)
    if layers is not None:
        fields["num_layers"] = layers
    return ModelConfig(**fields)


def shard_sizes(shape: torch.Size, world: int, rank: int) -> tuple[int, int]:
    """(padded, this rank's) element counts of an FSDP2 Shard(0) shard (torch.chunk semantics)."""
    rest = math.prod(shape[1:])
    chunk = -(-shape[0] // world)
    mine = max(0, min(chunk, shape[0] - rank * chunk))
    return chunk * rest, mine * rest


def compute(args: argparse.Namespace) -> dict:
    from fsdp_speedloader.models import build_model

    cfg = model_config(args.model, args.layers)
    model = build_model(cfg, device="meta")
    params = dict(model.named_parameters())  # tied weights appear once, as in FSDP2
    shards = pinned_shards = arena_shards = grads = pinned_grads = 0
    for p in params.values():
        padded, mine = shard_sizes(p.shape, args.world_size, args.rank)
        shards += padded * 4  # fp32 shards
        pinned_shards += pow2(padded * 4)
        arena_shards += align(padded * 4)
        grads += mine * 4
        pinned_grads += pow2(mine * 4)
    units = -(-cfg.num_layers // args.blocks_per_unit)
    act_bytes = (units + 1) * args.num_sub_batches * args.sub_batch_size * args.seq_len * cfg.hidden_size * 2  # bf16
    arena_grads = sum(align(shard_sizes(p.shape, args.world_size, args.rank)[1] * 4) for p in params.values())
    pytorch_total = pinned_shards + pinned_grads + pow2(act_bytes)
    arena_total = align(act_bytes) + arena_shards + arena_grads
    num_params = sum(p.numel() for p in params.values())
    optimizer = num_params * 8 // args.world_size  # Adam moments, fp32, pageable
    return {
        "config": {"model": args.model, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                   "num_params": num_params, "world_size": args.world_size, "rank": args.rank,
                   "num_sub_batches": args.num_sub_batches, "sub_batch_size": args.sub_batch_size,
                   "seq_len": args.seq_len, "blocks_per_unit": args.blocks_per_unit, "activation_dtype": "bfloat16"},
        "param_shards": {"requested": shards, "pinned_by_fsdp2": pinned_shards, "arena": arena_shards},
        "gradients": {"requested": grads, "pinned_by_fsdp2": pinned_grads, "arena": arena_grads},
        "activations": {"requested": act_bytes, "pinned_host_sync_store": pow2(act_bytes), "arena": align(act_bytes)},
        "page_locked_total": {"pytorch_pinning": pytorch_total, "arena": arena_total,
                              "requested": shards + grads + act_bytes, "saved": pytorch_total - arena_total,
                              "arena_padding": arena_total - shards - grads - act_bytes},
        "host_total_with_adam_moments": {"pytorch_pinning": pytorch_total + optimizer,
                                         "arena": arena_total + optimizer},
    }


MODES = {
    "exact-fp32": dict(grad_slots_in_flight=0, state_dtype="fp32"),
    "in-flight-grads": dict(grad_slots_in_flight=None, state_dtype="fp32"),
    "bf16-states": dict(grad_slots_in_flight=None, state_dtype="bf16"),
    "int8-states": dict(grad_slots_in_flight=None, state_dtype="int8"),
    "bf16-master-int8": dict(grad_slots_in_flight=None, state_dtype="int8", master_dtype="bf16"),
}


def compute_modes(args: argparse.Namespace, model_name: str) -> dict:
    """Per mode: the host plan by tier (bytes and bytes per parameter), whether it fits, the largest that does."""
    from fsdp_speedloader.app.host_memory import unit_and_root_shards
    from fsdp_speedloader.memory.bf16_master import MASTER_BYTES_PER_PARAM
    from fsdp_speedloader.memory.host_plan import TIERS, plan_host_memory
    from fsdp_speedloader.models import build_model

    cfg = model_config(model_name, args.layers)
    model = build_model(cfg, device="meta")
    units, root = unit_and_root_shards(model, blocks_per_unit=args.blocks_per_unit, shards=args.world_size,
                                       rank=args.rank)
    num_units = len(units)
    activations = 0
    if args.activation_store == "host":
        activations = ((num_units + 1) * args.num_sub_batches * args.sub_batch_size * args.seq_len
                       * cfg.hidden_size * 2)
    budget = int(args.host_gib * GIB * 0.9 - args.host_overhead_gib * GIB)
    out = {}
    for mode, spec in MODES.items():
        in_flight = args.grad_slots_in_flight if spec["grad_slots_in_flight"] is None else 0
        plan = plan_host_memory(units=units, root=root, root_on_host=not args.root_on_device,
                                grad_slots_in_flight=in_flight, state_dtype=spec["state_dtype"],
                                activation_bytes=activations,
                                transfer_itemsize=2 if args.param_transfer else 0,
                                param_itemsize=MASTER_BYTES_PER_PARAM[spec.get("master_dtype", "fp32")])
        # What scales with the parameters, and what does not (activations; the in-flight regions: one unit's).
        fixed = plan.activations + (plan.grads if in_flight else 0)
        per_param = (plan.total - fixed) / plan.num_params
        largest = (budget - fixed) / per_param if budget > fixed else 0
        out[mode] = {"grad_slots_in_flight": in_flight, "state_dtype": spec["state_dtype"],
                     "master_dtype": spec.get("master_dtype", "fp32"),
                     "bytes": plan.by_tier(), "total_bytes": plan.total, "num_params": plan.num_params,
                     "bytes_per_param": plan.bytes_per_param(), "fits": plan.total <= budget,
                     "budget_bytes": budget, "largest_params_that_fit": int(largest)}
    return {"model": model_name, "num_params": sum(p.numel() for p in model.parameters()), "num_units": num_units,
            "hidden_size": cfg.hidden_size, "tiers": list(TIERS), "modes": out}


def print_modes(report: dict, args: argparse.Namespace) -> None:
    print(f"\n{report['model']} ({report['num_params'] / 1e9:.2f}B parameters, {report['num_units']} units), world "
          f"size {args.world_size}, activations on the {args.activation_store}: host bytes per parameter "
          f"(budget {args.host_gib:g} GiB x 0.9 - {args.host_overhead_gib:g} GiB)")
    print("| mode | param shards | grads | optimizer states | activations | transfer | total B/param | total GiB "
          "| fits | largest that fits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, m in report["modes"].items():
        b = m["bytes_per_param"]
        print(f"| {mode} | {b['param_shards']:.2f} | {b['grads']:.2f} | {b['optimizer_states']:.2f} | "
              f"{b['activations']:.2f} | {b['param_transfer']:.2f} | {b['total']:.2f} | {m['total_bytes'] / GIB:.1f} | "
              f"{'yes' if m['fits'] else 'no'} | {m['largest_params_that_fit'] / 1e9:.1f}B |")


def run_worker(args: argparse.Namespace) -> dict:
    """On the GPU, ``--worker STORE``: one training step with that activation store on ``--layers`` layers; the
    page-locked bytes of the caching host allocator and of the arena."""
    from fsdp_speedloader import SpeedLoaderOptions, apply_speedloader, speedloader_engine
    from fsdp_speedloader.models import build_model, materialize_model

    cfg = model_config(args.model, args.layers)
    model = build_model(cfg, device="meta")
    options = SpeedLoaderOptions(num_sub_batches=args.num_sub_batches, activation_store=args.worker,
                                 offload_params=True, param_dtype=torch.bfloat16, blocks_per_unit=args.blocks_per_unit)
    apply_speedloader(model, options)
    materialize_model(model, cfg, device=torch.device("cuda"), seed=0, param_device=torch.device("cpu"))
    ids = torch.randint(0, cfg.vocab_size, (args.num_sub_batches * args.sub_batch_size, args.seq_len))
    model(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    allocator = torch.cuda.host_memory_stats()
    store = speedloader_engine(model).store
    stats = store.step_stats()
    return {"caching_host_allocator_bytes": allocator.get("allocated_bytes.current", 0),
            "arena_page_locked_bytes": stats.get("arena_page_locked_bytes", 0), "host_store_bytes": store.host_bytes,
            "arena": {k: v for k, v in stats.items() if k.startswith("arena_")},
            "exchange": {k: v for k, v in stats.items() if k.startswith("exchange")}}


def measure(args: argparse.Namespace) -> dict:
    """Both stores measured, each in its own process (a fresh CUDA context and host allocator)."""
    env = dict(os.environ)
    if args.host_memory_limit_gib:
        env["FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB"] = str(args.host_memory_limit_gib)
    out = {}
    for store in ("host_sync", "host"):
        outcome = harness.launch_worker(harness.worker_command(__file__, store, sys.argv[1:]), env)
        if not outcome.ok:
            raise RuntimeError(f"{store}: {outcome.status}: {outcome.error}")
        rec = outcome.result
        rec["page_locked_total"] = rec["caching_host_allocator_bytes"] + rec["arena_page_locked_bytes"]
        out[store] = rec
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama2_7b,llama2_13b,qwen3_14b", help="conf/model/*.yaml names")
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)  # --measure's worker: one model
    parser.add_argument("--layers", type=int, default=None, help="override num_layers")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0, help="rank 0 holds the largest (padded) shards")
    parser.add_argument("--num-sub-batches", type=int, default=8)
    parser.add_argument("--sub-batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--blocks-per-unit", type=int, default=1)
    parser.add_argument("--activation-store", default="device", choices=("device", "host"),
                        help="modes: the activations on the GPU (no host tier) or in the host arena")
    parser.add_argument("--grad-slots-in-flight", type=int, default=OptimConfig().grad_slots_in_flight,
                        help="modes: R of the in-flight gradients (default: optim.grad_slots_in_flight's)")
    parser.add_argument("--root-on-device", action="store_true", help="modes: offload.root=false")
    parser.add_argument("--param-transfer", action="store_true", help="modes: bf16 transfer copies")
    parser.add_argument("--host-gib", type=float, default=128.0, help="modes: the machine's host memory")
    parser.add_argument("--host-overhead-gib", type=float, default=4.0,
                        help="modes: host memory the process takes besides the plan (CUDA context, libraries)")
    parser.add_argument("--measure", action="store_true", help="also measure on the GPU (world size 1)")
    parser.add_argument("--host-memory-limit-gib", type=float, default=None,
                        help="host budget for the arena check (a VM whose MemTotal grows on demand needs it)")
    parser.add_argument("--out", default=None, help="JSON path (one model; default "
                                                    "bench/results/arena_report_<model>_w<W>.json)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # an activation store, measured
    args = parser.parse_args()
    if args.worker:
        harness.print_result(run_worker(args))
        return

    def gib(n):
        return "-" if n is None else f"{n / GIB:.2f}"

    models = [args.model] if args.model else [m for m in args.models.split(",") if m]
    if args.out and len(models) != 1:
        parser.error("--out names one record: pass one model (--models NAME)")
    for name in models:
        args.model = name
        record = {**harness.record_header("arena_report", __file__,
                                          device=None if args.measure else "cpu (computed)"),
                  **compute(args), "host_memory_by_mode": compute_modes(args, name)}
        if args.measure:
            record["measured"] = measure(args)
        default = REPO / "bench" / "results" / f"arena_report_{name}_w{args.world_size}.json"
        out = harness.write_record(args.out or default, record)
        print(f"{name}, world size {args.world_size}, rank {args.rank}: page-locked GiB, PyTorch's pinning vs the arena "
              "(a gradient slot per parameter, activations in the arena)")
        print("| what | requested | PyTorch's pinning | arena |\n|---|---|---|---|")
        print(f"| fp32 parameter shards | {gib(record['param_shards']['requested'])} | "
              f"{gib(record['param_shards']['pinned_by_fsdp2'])} | {gib(record['param_shards']['arena'])} |")
        print(f"| activation slots (bf16) | {gib(record['activations']['requested'])} | "
              f"{gib(record['activations']['pinned_host_sync_store'])} | {gib(record['activations']['arena'])} |")
        print(f"| fp32 gradient shards | {gib(record['gradients']['requested'])} | "
              f"{gib(record['gradients']['pinned_by_fsdp2'])} | {gib(record['gradients']['arena'])} |")
        total = record["page_locked_total"]
        print(f"| total | {gib(total['requested'])} | {gib(total['pytorch_pinning'])} | {gib(total['arena'])} |")
        if args.measure:
            for store, rec in record["measured"].items():
                print(f"measured ({store}): {gib(rec['page_locked_total'])} GiB page-locked "
                      f"(caching host allocator {gib(rec['caching_host_allocator_bytes'])}, "
                      f"arena {gib(rec['arena_page_locked_bytes'])})")
        print_modes(record["host_memory_by_mode"], args)
        print(f"wrote {out}\n")


if __name__ == "__main__":
    main()
