"""The tuner on one GPU: a 7B-width model (4 layers, seq 4096, bf16, parameters offloaded, activations in
the host arena) under a 40 GiB cap, with PyTorch's default CUDA allocator and with expandable segments.
Two trial steps (n = 2, 4) predict the peak GPU memory allocated at other sub-batch sizes -- n = 8 and
the plan's own n -- within 5%; the plan's n runs (the cap limits reserved memory: the plan budgets the
reserved line too, and the margin covers its error); host memory is never under-predicted, and
over-predicted by no more than the spread of the constant the trials measured (plus 1%).

Run on the GPU machine (its MemTotal starts at 31 GiB and grows, so give the host limit explicitly)::

    FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB=120 python -m pytest -m gpu tests/test_tuner_gpu.py -s

Without the variable the test sets it to 120 GiB. With FSL_RECORD_DIR set, the figures are also written
there as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

import pytest
import torch

import fsdp_speedloader
from fsdp_speedloader import SpeedLoaderOptions
from fsdp_speedloader.app.config import ModelConfig, OptimConfig
from fsdp_speedloader.app.optim import build_optimizer
from fsdp_speedloader.app.runtime import maybe_cap_gpu_memory
from fsdp_speedloader.memory.arena import LIMIT_ENV, HostMemoryBudget
from fsdp_speedloader.parallel import build_mesh, maybe_init_process_group
from fsdp_speedloader.tuning.trial import TrialModel, cuda_allocator_settings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GIB = 1 << 30
SEQ, LAYERS, CAP_GIB, N = 4096, 4, 40.0, 2
MODEL = ModelConfig(name="llama2_7b_width", hidden_size=4096, intermediate_size=11008, num_layers=LAYERS, num_heads=32,
                    vocab_size=32000, max_position_embeddings=SEQ)


ALLOCATORS = {"default": "expandable_segments:False", "expandable_segments": "expandable_segments:True"}


def _set_allocator_settings(settings: str) -> None:
    """At run time: new segments follow them (torch.cuda.memory._set_allocator_settings before torch 2.9)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(settings)


def _expandable_segments_in_use() -> Optional[bool]:
    """Whether the allocator's segments are expandable (None: the snapshot does not say)."""
    segments = torch.cuda.memory_snapshot()
    flags = [seg["is_expandable"] for seg in segments if "is_expandable" in seg]
    return any(flags) if flags else None


@pytest.fixture(params=sorted(ALLOCATORS))
def capped_gpu(monkeypatch, request):
    if not os.environ.get(LIMIT_ENV):
        monkeypatch.setenv(LIMIT_ENV, "120")
    maybe_init_process_group("cuda")
    device = torch.device("cuda", torch.cuda.current_device())
    maybe_cap_gpu_memory(CAP_GIB, device)
    previous = cuda_allocator_settings()
    torch.cuda.empty_cache()  # every segment from here on follows the settings
    _set_allocator_settings(ALLOCATORS[request.param])
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", ALLOCATORS[request.param])  # what a torch without a getter reports
    yield device, request.param
    torch.cuda.empty_cache()
    _set_allocator_settings(previous or ALLOCATORS["default"])
    torch.cuda.set_per_process_memory_fraction(1.0, device)


def test_predicted_peak_gpu_memory_within_5_percent(capped_gpu):
    _, allocator = capped_gpu
    budget = HostMemoryBudget.detect()
    assert budget.source == LIMIT_ENV and budget.limit_bytes == int(float(os.environ[LIMIT_ENV]) * GIB)
    options = SpeedLoaderOptions(offload_params=True, activation_store="host", param_dtype=torch.bfloat16)
    plan = fsdp_speedloader.tune(MODEL, options, seq_len=SEQ, gpu_memory_budget_bytes=int(CAP_GIB * GIB),
                                 trial_num_sub_batches=N)
    print("\n" + plan.summary())
    assert LIMIT_ENV in plan.host_budget_source, "the host budget comes from the environment variable"
    assert plan.predicted_host_bytes <= plan.host_budget_bytes
    assert plan.predicted_gpu_bytes <= plan.predicted_gpu_reserved_bytes <= 0.9 * CAP_GIB * GIB
    assert [m.sub_batch_size for m in plan.measurements] == [2, 4], "the trials fell back to smaller sub-batches"
    assert (allocator == "expandable_segments") == ("expandable_segments:True" in plan.gpu_allocator_settings)
    constants = [m.host_bytes - m.host_activation_bytes for m in plan.measurements]
    spread = max(constants) - min(constants)  # e.g. page-locked blocks the caching host allocator kept

    # New steps, on a fresh copy of the model: n = 8 and the plan's n, same N as the trials.
    checks = sorted({8, plan.sub_batch_size}, reverse=True)  # the largest right after the prime, as the tuner
    # The trials kept one (unit, sub-batch) pair to measure its bytes: so do the checks of their fit.
    with TrialModel(MODEL, options.replace(num_sub_batches=N, keep_activations=1), mesh=build_mesh("cuda"), seed=0,
                    build_optimizer=lambda m: build_optimizer(m, OptimConfig())) as trial:
        trial.prime(max(checks), SEQ)
        measured = [trial.measure(n, SEQ) for n in checks]
        expandable = _expandable_segments_in_use()  # while the trial model holds GPU memory
    assert expandable in (None, allocator == "expandable_segments"), "the allocator settings did not take effect"
    rows = []
    for m in measured:
        n = m.sub_batch_size
        gpu, reserved = plan.predict_gpu_bytes(n, N), plan.predict_gpu_reserved_bytes(n, N)
        host = plan.predict_host_bytes(n, N)
        rows.append({"sub_batch_size": n, "num_sub_batches": N,
                     "measured_gpu_gib": m.gpu_peak_bytes / GIB, "predicted_gpu_gib": gpu / GIB,
                     "gpu_error": gpu / m.gpu_peak_bytes - 1, "measured_reserved_gib": m.gpu_reserved_bytes / GIB,
                     "predicted_reserved_gib": reserved / GIB, "reserved_error": reserved / m.gpu_reserved_bytes - 1,
                     "measured_host_gib": m.host_bytes / GIB, "predicted_host_gib": host / GIB,
                     "host_error": host / m.host_bytes - 1, "host_over_bytes": host - m.host_bytes,
                     "host_breakdown": m.host_breakdown})
        print(f"n={n}: GPU measured {m.gpu_peak_bytes / GIB:.3f} GiB, predicted {gpu / GIB:.3f} GiB "
              f"({rows[-1]['gpu_error']:+.2%}); reserved measured {m.gpu_reserved_bytes / GIB:.3f} GiB, predicted "
              f"{reserved / GIB:.3f} GiB ({rows[-1]['reserved_error']:+.2%}); host measured {m.host_bytes / GIB:.3f} "
              f"GiB, predicted {host / GIB:.3f} GiB ({rows[-1]['host_error']:+.3%})")
        assert m.host_breakdown["arena_activations"] == m.activation_tokens * m.activation_bytes_per_token
    if os.environ.get("FSL_RECORD_DIR"):
        record = {"test": "tuner_predicted_peak", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "model": "llama 7B width", "layers": LAYERS, "seq_len": SEQ, "cap_gib": CAP_GIB,
                  "allocator": allocator, "expandable_segments_in_use": expandable, "plan": plan.as_dict(),
                  "host_constant_spread_bytes": spread, "checks": rows}
        out = Path(os.environ["FSL_RECORD_DIR"], f"tuner_gpu_prediction_{allocator}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2))
    # The plan itself, with unit 1's states and the kept pairs it planned in the memory left over: its peak as
    # predicted.
    with TrialModel(MODEL, options.replace(num_sub_batches=N, keep_activations=plan.keep_activations,
                                           device_units=plan.device_units),
                    mesh=build_mesh("cuda"), seed=0, build_optimizer=lambda m: build_optimizer(m, OptimConfig())) as run:
        planned = run.measure(plan.sub_batch_size, SEQ)
    kept_error = plan.predicted_gpu_bytes / planned.gpu_peak_bytes - 1
    print(f"plan n={plan.sub_batch_size}, device_units={plan.device_units}, keep_activations={plan.keep_activations}: "
          f"GPU measured {planned.gpu_peak_bytes / GIB:.3f} GiB, predicted {plan.predicted_gpu_bytes / GIB:.3f} GiB "
          f"({kept_error:+.2%})")
    assert plan.keep_activations >= 1 and planned.gpu_reserved_bytes <= CAP_GIB * GIB
    assert -plan.gpu_margin <= kept_error <= 0.25, (kept_error, plan.keep_activations)
    for row in rows:
        assert abs(row["gpu_error"]) <= 0.05, row
        # What the reserved line misses, the margin must cover: else a plan at the target runs out of memory.
        assert row["reserved_error"] >= -plan.gpu_margin, row
        assert row["host_error"] >= -0.01, row
        assert row["host_over_bytes"] <= spread + 0.01 * row["measured_host_gib"] * GIB, row


def test_trials_time_the_forward_backward_and_the_overlapped_cpu_step(monkeypatch):
    """With an overlapped optimizer a trial step times its forward+backward (the GPU synchronized after it) and the
    worker's CPU step, counts the host parameters that step updates and the share of pairs recomputed: what the
    planner's host-step rule (more units on the GPU where the CPU step would show) reads."""
    if not os.environ.get(LIMIT_ENV):
        monkeypatch.setenv(LIMIT_ENV, "120")
    maybe_init_process_group("cuda")
    model = dataclasses.replace(MODEL, num_layers=2)
    options = SpeedLoaderOptions(offload_params=True, activation_store="host", param_dtype=torch.bfloat16,
                                 num_sub_batches=2, keep_activations=1)
    optim = OptimConfig(overlap_with_backward=True, grad_clip=0.0)
    with TrialModel(model, options, mesh=build_mesh("cuda"), seed=0,
                    build_optimizer=lambda m: build_optimizer(m, optim)) as trial:
        m = trial.measure(1, 1024)
        local = [p.to_local() if hasattr(p, "to_local") else p for p in trial.model.parameters()]
        host = sum(t.numel() for t in local if t.device.type == "cpu")
    print(f"\nfwd+bwd {m.fwd_bwd_s:.3f} s of a {m.step_s:.3f} s step; CPU step {m.host_step_s:.3f} s over {host:,} "
          "parameters")
    assert 0 < m.fwd_bwd_s <= m.step_s
    assert m.host_step_s > 0 and m.host_step_params == host > 0
    assert m.recomputed_share == 1 - 1 / (2 * 2)  # 2 units x 2 sub-batches, one pair kept
