"""The tuner on one GPU: a 7B-width model (4 layers, seq 4096, bf16, parameters offloaded, activations in
the host arena) under a 40 GiB cap. Two trial steps (n = 2, 4) predict the peak GPU memory of other
sub-batch sizes -- n = 8 and the plan's own n -- within 5%, and host memory within 1%.

Run on the GPU machine (its MemTotal starts at 31 GiB and grows, so give the host limit explicitly)::

    FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB=120 python -m pytest -m gpu tests/test_tuner_gpu.py -s

Without the variable the test sets it to 120 GiB. With FSL_RECORD_DIR set, the figures are also written
there as JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import fsdp_speedloader
from fsdp_speedloader.arena import LIMIT_ENV, HostMemoryBudget
from fsdp_speedloader.config import ModelConfig, OptimConfig
from fsdp_speedloader.parallel import build_mesh, maybe_init_process_group
from fsdp_speedloader.trainer import build_optimizer, maybe_cap_gpu_memory
from fsdp_speedloader.trial import TrialModel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GIB = 1 << 30
SEQ, LAYERS, CAP_GIB, N = 4096, 4, 40.0, 2
MODEL = ModelConfig(name="llama2_7b_width", hidden_size=4096, intermediate_size=11008, num_layers=LAYERS, num_heads=32,
                    vocab_size=32000, max_position_embeddings=SEQ)


@pytest.fixture
def capped_gpu(monkeypatch):
    if not os.environ.get(LIMIT_ENV):
        monkeypatch.setenv(LIMIT_ENV, "120")
    maybe_init_process_group("cuda")
    device = torch.device("cuda", torch.cuda.current_device())
    maybe_cap_gpu_memory(CAP_GIB, device)
    yield device
    torch.cuda.set_per_process_memory_fraction(1.0, device)
    torch.cuda.empty_cache()


def test_predicted_peak_gpu_memory_within_5_percent(capped_gpu):
    device = capped_gpu
    budget = HostMemoryBudget.detect()
    assert budget.source == LIMIT_ENV and budget.limit_bytes == int(float(os.environ[LIMIT_ENV]) * GIB)
    kwargs = dict(offload_params=True, activation_store="host", param_dtype=torch.bfloat16)
    plan = fsdp_speedloader.tune(MODEL, seq_len=SEQ, gpu_memory_budget_bytes=int(CAP_GIB * GIB),
                                 trial_num_sub_batches=N, **kwargs)
    print("\n" + plan.summary())
    assert LIMIT_ENV in plan.host_budget_source, "the host budget comes from the environment variable"
    assert plan.predicted_host_bytes <= plan.host_budget_bytes
    assert plan.predicted_gpu_bytes <= 0.9 * CAP_GIB * GIB
    assert [m.sub_batch_size for m in plan.measurements] == [2, 4], "the trials fell back to smaller sub-batches"

    # New steps, on a fresh copy of the model: n = 8 and the plan's n, same N as the trials.
    checks = sorted({8, plan.sub_batch_size})
    with TrialModel(MODEL, dict(num_sub_batches=N, mesh=build_mesh("cuda"), **kwargs), device=device, seed=0,
                    build_optimizer=lambda m: build_optimizer(m, OptimConfig())) as trial:
        trial.prime(max(checks), SEQ)
        measured = [trial.measure(n, SEQ) for n in checks]
    rows = []
    for m in measured:
        gpu, host = plan.predict_gpu_bytes(m.sub_batch_size, N), plan.predict_host_bytes(m.sub_batch_size, N)
        rows.append({"sub_batch_size": m.sub_batch_size, "num_sub_batches": N,
                     "measured_gpu_gib": m.gpu_peak_bytes / GIB, "predicted_gpu_gib": gpu / GIB,
                     "gpu_error": gpu / m.gpu_peak_bytes - 1, "measured_host_gib": m.host_bytes / GIB,
                     "predicted_host_gib": host / GIB, "host_error": host / m.host_bytes - 1,
                     "reserved_gpu_gib": m.gpu_reserved_bytes / GIB, "host_breakdown": m.host_breakdown})
        print(f"n={m.sub_batch_size}: GPU measured {m.gpu_peak_bytes / GIB:.3f} GiB, predicted {gpu / GIB:.3f} GiB "
              f"({rows[-1]['gpu_error']:+.2%}); host measured {m.host_bytes / GIB:.3f} GiB, predicted "
              f"{host / GIB:.3f} GiB ({rows[-1]['host_error']:+.3%})")
    if os.environ.get("FSL_RECORD_DIR"):
        record = {"test": "tuner_predicted_peak", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "model": "llama 7B width", "layers": LAYERS, "seq_len": SEQ, "cap_gib": CAP_GIB,
                  "plan": plan.as_dict(), "checks": rows}
        out = Path(os.environ["FSL_RECORD_DIR"], "tuner_gpu_prediction.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2))
    for row in rows:
        assert abs(row["gpu_error"]) <= 0.05, row
        assert abs(row["host_error"]) <= 0.01, row
