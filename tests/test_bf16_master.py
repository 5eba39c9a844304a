"""bf16 master weights (``optim.master_dtype=bf16``, memory/bf16_master.py): stochastic rounding, the optimizer, the
trainer (bf16 shards on the host, the plan's bytes, training, exact resume), and the refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed, tiny_config
from fsdp_speedloader.app.config import OptimConfig, TrainConfig
from fsdp_speedloader.app.host_memory import host_memory_plan
from fsdp_speedloader.app.trainer import Trainer
from fsdp_speedloader.memory.bf16_master import noise_key, random_bits, reference_bits, stochastic_round_
from fsdp_speedloader.memory.compressed_adamw import CompressedAdamW
from fsdp_speedloader.models import build_model

# --- stochastic rounding ------------------------------------------------------------------------------------------


def _round(x: torch.Tensor, **key) -> torch.Tensor:
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    stochastic_round_(out, x.clone(), random_bits(x.numel(), **{"seed": 0, "index": 0, "step": 1, **key}))
    return out


def test_stochastic_rounding_picks_a_neighbour_with_the_right_odds():
    """1 + 2^-9 lies a quarter of the way from bf16's 1 to its next value 1 + 2^-7: rounded up a quarter of the
    time, so the mean stays the value; negative values the same, mirrored; and other fractions of a step (a
    standard error of sqrt(q (1 - q) / n): bounds of 5 of them, on the share and on the mean)."""
    n = 400_000
    for sign in (1.0, -1.0):
        x = torch.full((n,), sign * (1 + 2**-9))
        out = _round(x).float()
        assert set(out.unique().tolist()) == {sign * 1.0, sign * (1 + 2**-7)}
        assert (out.abs() > 1).float().mean().item() == pytest.approx(0.25, abs=0.005)
        assert out.mean().item() == pytest.approx(sign * (1 + 2**-9), abs=1e-5)
    low, step = 3.0, 2**-6  # bf16 neighbours 3 and 3 + 2^-6
    for q in (1 / 65536, 0.1, 0.5, 0.9):
        value = torch.tensor(low + q * step, dtype=torch.float32).item()  # the fp32 value nearest
        q = (value - low) / step
        se = math.sqrt(q * (1 - q) / n)
        out = _round(torch.full((n,), value), step=7).double()
        up = (out > low).double().mean().item()
        assert abs(up - q) < 5 * se + 1e-12, (q, up)
        assert abs(out.mean().item() - value) < 5 * se * step + 1e-12, q


def test_stochastic_rounding_keeps_bf16_values_and_non_finite_ones():
    exact = torch.tensor([0.0, -0.0, 1.0, -3.5, 2.0**-100, 65280.0])  # all representable in bf16
    assert torch.equal(_round(exact).float(), exact)
    special = torch.tensor([float("inf"), float("-inf"), float("nan")])
    out = _round(special).float()
    assert out[0] == float("inf") and out[1] == float("-inf") and math.isnan(out[2])
    with pytest.raises(ValueError, match="bf16 out"):
        stochastic_round_(torch.empty(3), torch.zeros(3), random_bits(3, seed=0, index=0, step=1))


PIECE = 1 << 16  # random_bits' pieces on the host: cuts across and beside their boundaries


def test_random_bits_depend_on_the_position_not_on_the_chunking():
    """The optimizer chunks a parameter by its thread count; the bits of element i must not change with it."""
    n = 3 * PIECE + 123
    whole = random_bits(n, seed=7, index=3, step=5)
    cut = PIECE + 1000
    pieces = torch.cat([random_bits(cut, seed=7, index=3, step=5),
                        random_bits(n - cut, seed=7, index=3, step=5, offset=cut)])
    assert torch.equal(whole, pieces)
    scratch = torch.full((n,), -1, dtype=torch.int32)  # the optimizer's reused buffer
    assert random_bits(n, seed=7, index=3, step=5, out=scratch) is scratch and torch.equal(scratch, whole)
    assert whole.min() >= 0 and whole.max() < 1 << 16
    assert not torch.equal(whole, random_bits(n, seed=7, index=3, step=6))  # another step, other bits
    assert not torch.equal(whole, random_bits(n, seed=7, index=4, step=5))  # another parameter, other bits
    assert not torch.equal(whole, random_bits(n, seed=8, index=3, step=5))  # another seed, other bits


@pytest.mark.parametrize("offset", [0, 1, PIECE - 5, 12_345, (1 << 32) + 3, (1 << 62) + 99])
def test_random_bits_are_splitmix64_of_the_key_and_the_position(offset):
    """The torch int64 operations (wrapping multiplications, masked arithmetic shifts) give the definition's bits,
    computed in Python integers, at offsets aligned to nothing, across the pieces' boundaries, near 2^63."""
    n = 2 * PIECE + 17
    bits = random_bits(n, seed=11, index=2, step=9, offset=offset)
    key = noise_key(11, 2, 9)
    checked = [0, 1, 4, PIECE - 1, PIECE, PIECE + 1, 2 * PIECE, n - 1, *range(7, n, 1009)]
    assert [int(bits[i]) for i in checked] == [reference_bits(key, offset + i) for i in checked]
    assert noise_key(11, 2, 9) != noise_key(11, 2, 10) != noise_key(11, 3, 9)


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a * b).mean() / (a.std() * b.std()))


def test_random_bits_look_uniform_and_uncorrelated():
    """Over 2^20 elements: the 16-bit values' mean and variance those of the uniform distribution, each bit set half
    the time, and no correlation between neighbouring positions, consecutive steps, neighbouring parameters (a
    standard error of 1/1024 each: bounds of 5 of them)."""
    n = 1 << 20
    bits = random_bits(n, seed=0, index=5, step=100)
    se = 1 / math.sqrt(n)
    uniform_sd = math.sqrt((65536**2 - 1) / 12)
    assert abs(bits.double().mean().item() - 32767.5) < 5 * uniform_sd * se
    assert bits.double().std().item() == pytest.approx(uniform_sd, rel=5 * se)
    for b in range(16):
        assert abs(((bits >> b) & 1).double().mean().item() - 0.5) < 5 * 0.5 * se, b
    assert abs(_correlation(bits[1:], bits[:-1])) < 5 * se  # lag 1 in position
    assert abs(_correlation(bits[2:], bits[:-2])) < 5 * se
    next_step = random_bits(n, seed=0, index=5, step=101)
    assert abs(_correlation(bits, next_step)) < 5 * se  # the same positions, the next step
    assert abs(_correlation(bits, random_bits(n, seed=0, index=6, step=100))) < 5 * se  # the next parameter
    assert abs(_correlation(bits, random_bits(n, seed=1, index=5, step=100))) < 5 * se  # the next seed


# --- the optimizer ------------------------------------------------------------------------------------------------


def _tiny_lr_run(rounding: str, steps: int = 60) -> torch.Tensor:
    """bf16 parameters at 1.0 whose every AdamW update (lr 1e-4, about 1e-4 each) is under half a bf16 step."""
    p = torch.nn.Parameter(torch.ones(20_000, dtype=torch.bfloat16))
    opt = CompressedAdamW([p], state_dtype="bf16", lr=1e-4, weight_decay=0.0, rounding=rounding, seed=1)
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        opt.step()
    return p.detach().float()


def test_stochastic_rounding_keeps_updates_that_round_to_nearest_loses():
    """fp32 masters move by 60 x 1e-4 = 0.006; bf16 rounded to nearest never leaves 1.0 (the step is 2^-8 below
    1); stochastic rounding moves by the same amount on average."""
    assert torch.equal(_tiny_lr_run("nearest"), torch.ones(20_000))
    moved = 1.0 - _tiny_lr_run("stochastic").mean().item()
    assert moved == pytest.approx(0.006, rel=0.05)


def test_stochastic_rounding_is_reproducible():
    assert torch.equal(_tiny_lr_run("stochastic", steps=5), _tiny_lr_run("stochastic", steps=5))
    with pytest.raises(ValueError, match="rounding"):
        CompressedAdamW([torch.nn.Parameter(torch.ones(2))], rounding="up")


# --- the configuration and the host plan ----------------------------------------------------------------------


def test_bf16_masters_are_refused_where_they_cannot_apply(tmp_path):
    with pytest.raises(ValueError, match="optim.state_dtype=bf16 or int8"):
        OptimConfig(master_dtype="bf16")
    with pytest.raises(ValueError, match="optim.master_dtype"):
        OptimConfig(master_dtype="fp16", state_dtype="bf16")
    with pytest.raises(ValueError, match="set offload=params"):
        tiny_config(tmp_path, schedule={"name": "speedloader"}, optim={"master_dtype": "bf16", "state_dtype": "int8"})


def test_the_host_plan_counts_two_bytes_per_master_and_gradient(tmp_path):
    """Parameter shards and gradients halve; the moments do not change; fp32 masters are offered the switch."""
    def config(master: str) -> TrainConfig:
        return tiny_config(tmp_path, schedule={"name": "speedloader"}, offload={"params": True},
                           optim={"master_dtype": master, "state_dtype": "int8"})

    model = build_model(config("fp32").model, device="meta")
    fp32, alternatives = host_memory_plan(model, config("fp32"), shards=1)
    bf16, _ = host_memory_plan(model, config("bf16"), shards=1)
    assert bf16.param_shards * 2 == pytest.approx(fp32.param_shards, rel=0.01)
    assert bf16.grads * 2 == pytest.approx(fp32.grads, rel=0.01)
    assert bf16.optimizer_states == fp32.optimizer_states
    offered = dict(alternatives)
    assert offered["optim.master_dtype=bf16 (bf16 master weights, stochastic rounding)"].total == bf16.total


# --- through the trainer ------------------------------------------------------------------------------------------


def _config(out: Path, ckpt: Path, resume=None, **optim):
    optim = {"master_dtype": "bf16", "state_dtype": "int8", "overlap_with_backward": True, "grad_clip": 0.0, **optim}
    return tiny_config(out, schedule={"name": "speedloader"}, offload={"params": True}, optim=optim, steps=4,
                       checkpoint={"every": 2, "dir": str(ckpt), "save_final": False, "resume": resume})


def _resume(root: Path) -> tuple[list, list, dict]:
    whole = Trainer(_config(root / "a", root / "a_ckpt"))
    uninterrupted = whole.train()
    Trainer(_config(root / "b", root / "b_ckpt")).train(max_steps=2)
    resumed_trainer = Trainer(_config(root / "c", root / "b_ckpt", resume="auto"))
    assert resumed_trainer.step == 2
    resumed = resumed_trainer.train()
    params = [p.full_tensor() for p in whole.model.parameters()], [p.full_tensor() for p in
                                                                    resumed_trainer.model.parameters()]
    return uninterrupted, resumed, {"dtypes": {str(p.dtype) for p in whole.model.parameters()},
                                    "same_params": all(torch.equal(a, b) for a, b in zip(*params))}


def test_bf16_masters_train_and_resume_exactly(tmp_path):
    """The shards are bf16 on the host (root included: offload.root), the loss falls like fp32 masters' within a
    few percent over 4 steps, and a resumed run equals the uninterrupted one (the rounding's bits are seeded by
    position and step, not by a random state)."""
    uninterrupted, resumed, out = _resume(tmp_path)
    assert out["dtypes"] == {"torch.bfloat16"}
    losses = [m["loss"] for m in uninterrupted]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert [m["loss"] for m in resumed] == losses[2:]
    assert out["same_params"]
    fp32 = [m["loss"] for m in Trainer(_config(tmp_path / "d", tmp_path / "d_ckpt", master_dtype="fp32")).train()]
    assert losses[-1] == pytest.approx(fp32[-1], rel=0.05)


@pytest.mark.parametrize("device_units", [0, 1])
def test_a_gpu_root_keeps_fp32_masters(tmp_path, device_units):
    """offload.root=false: only the blocks' masters become bf16 (the root's states live with it on the device);
    offload.device_units=K: not those of units 1 .. K either (stepped on the device by torch's AdamW)."""
    cfg = tiny_config(tmp_path, schedule={"name": "speedloader"}, steps=1,
                      offload={"params": True, "root": False, "device_units": device_units},
                      optim={"master_dtype": "bf16", "state_dtype": "bf16", "overlap_with_backward": True,
                             "grad_clip": 0.0})
    trainer = Trainer(cfg)
    trainer.train()
    host = {id(p) for block in list(trainer.adapter.blocks)[device_units:] for p in block.parameters()}
    dtypes = {(id(p) in host, p.dtype) for p in trainer.model.parameters()}
    assert dtypes == {(True, torch.bfloat16), (False, torch.float32)}


def _resume_2_ranks(rank: int, world_size: int, root: str) -> tuple:
    return _resume(Path(root))


def test_bf16_masters_resume_exactly_at_world_size_2(tmp_path):
    for uninterrupted, resumed, out in run_distributed(_resume_2_ranks, 2, str(tmp_path)):
        assert [m["loss"] for m in resumed] == [m["loss"] for m in uninterrupted[2:]]
        assert out["same_params"] and out["dtypes"] == {"torch.bfloat16"}


# --- on the GPU -----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("root_on_device", [False, True])
def test_bf16_masters_train_on_the_gpu_like_fp32_masters(tmp_path, root_on_device):
    """bf16 shards on the host go to the GPU as they are (FSDP2 has nothing to cast) through the staged loads and
    the in-flight gradient slots; the loss follows fp32 masters' within bf16 noise over a few steps."""
    from fsdp_speedloader.parallel import maybe_init_process_group

    maybe_init_process_group("cuda")

    def run(master: str, out: Path) -> list[float]:
        cfg = tiny_config(out, device="cuda", steps=6, schedule={"name": "speedloader"},
                          offload={"params": True, "root": not root_on_device},
                          optim={"master_dtype": master, "state_dtype": "int8", "overlap_with_backward": True,
                                 "grad_clip": 0.0})
        trainer = Trainer(cfg)
        losses = [m["loss"] for m in trainer.train()]
        blocks = {id(p) for p in trainer.adapter.blocks.parameters()}
        assert {p.dtype for p in trainer.model.parameters() if id(p) in blocks} == {DTYPES[master]}
        return losses

    DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
    bf16, fp32 = run("bf16", tmp_path / "bf16"), run("fp32", tmp_path / "fp32")
    assert all(math.isfinite(x) for x in bf16) and bf16[-1] < bf16[0]
    assert bf16[-1] == pytest.approx(fp32[-1], rel=0.05)
