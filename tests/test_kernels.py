"""The kernel levers (``fsdp_speedloader.kernels``) on the CPU: options and configs refuse bad values, a lever this
machine cannot run is refused in one line before anything is sharded, the SDPA scope covers every run of the blocks
(forward and recompute), Liger's per-module binding (with stand-in kernels of the same math) keeps gradients exact
and the model's state dict and other models untouched, float8 (torchao's emulation, where installed) leaves the
engine's gradients equal to the unmodified float8 model's, and the benchmark's suffixes and script are well formed.
The real kernels' gradient parity is in tests/test_gpu_kernels.py."""

from __future__ import annotations

import copy
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_cases import assert_grads_close, batch, cpu_mesh, reference_grads, tiny_model
from fsdp_speedloader import SpeedLoaderOptions, apply_speedloader
from fsdp_speedloader.app.config import KernelsConfig
from fsdp_speedloader.kernels import apply_kernels, kernel_scope, sdpa_backend
from fsdp_speedloader.models import LlamaAdapter

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import bench_train  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# --- values ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,match", [("sdpa_backend", "fast", "sdpa_backend: got 'fast'"),
                                               ("float8_training", "e4m3", "float8_training: got 'e4m3'"),
                                               ("liger_kernels", "yes", "liger_kernels: got 'yes'")])
def test_options_refuse_bad_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        SpeedLoaderOptions(**{field: value})


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="kernels.sdpa_backend"):
        KernelsConfig(sdpa_backend="flash2")
    with pytest.raises(ValueError, match="kernels.float8_training"):
        KernelsConfig(float8_training="fp8")
    assert KernelsConfig() == KernelsConfig(sdpa_backend="auto", liger_kernels=False, float8_training=None)


# --- refusals on this machine --------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,match", [
    ({"sdpa_backend": "cudnn"}, "sdpa_backend: 'cudnn' is a CUDA kernel"),
    ({"sdpa_backend": "flash"}, "sdpa_backend: 'flash' is a CUDA kernel"),
    ({"liger_kernels": True}, "liger_kernels"),
    ({"float8_training": "tensorwise"}, "float8_training='tensorwise'")])
def test_a_lever_this_machine_cannot_run_is_refused_before_sharding(overrides, match):
    if torch.cuda.is_available():
        pytest.skip("the refusals of a machine without CUDA")
    model = tiny_model("llama")
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=match) as err:
        apply_speedloader(model, mesh=cpu_mesh(), **overrides)
    assert "\n" not in str(err.value) and "set " in str(err.value)  # one line, naming what to set
    assert {n: type(m) for n, m in model.named_modules()} == before and not hasattr(model, "_speedloader")


def test_missing_packages_are_named(monkeypatch):
    for name in ("liger_kernel", "torchao", "torchao.float8"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"liger_kernels needs liger-kernel and triton .*fsdp-speedloader\[kernels\]"):
        apply_kernels(model, model.model.layers, device_type="cuda", liger_kernels=True)
    with pytest.raises(ValueError, match=r"float8_training='rowwise' needs torchao"):
        apply_kernels(model, model.model.layers, device_type="cuda", float8_training="rowwise")


def test_sdpa_backend_needs_sdpa_attention():
    model = tiny_model("llama")
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        apply_kernels(model, model.model.layers, device_type="cpu", sdpa="math")


# --- the scope covers forward and recompute ------------------------------------------------------------------------

def test_sdpa_scope_covers_every_run_of_the_blocks(monkeypatch):
    """sdpa_backend='math' (CPU): every unit's forward and its recompute in backward run inside the scope, with
    exactly the gradients of the unmodified model under the same backend."""
    model = tiny_model("llama")
    ids, labels = batch(3)
    with sdpa_backend("math"):
        _, ref = reference_grads(model, [(ids, labels)])
    inside = []
    run_block = LlamaAdapter.run_block

    def spy(self, block, hidden, inputs, *, compiled=False):  # sdpa_kernel([MATH]) turns the other backends off
        backends = torch.backends.cuda
        inside.append(backends.math_sdp_enabled() and not backends.flash_sdp_enabled()
                      and not backends.mem_efficient_sdp_enabled() and not backends.cudnn_sdp_enabled())
        return run_block(self, block, hidden, inputs, compiled=compiled)

    apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=3, offload_params=True, activation_store="host",
                      sdpa_backend="math")
    monkeypatch.setattr(LlamaAdapter, "run_block", spy)
    model(input_ids=ids, labels=labels).loss.backward()
    assert len(inside) == 2 * 4 * 3 and all(inside)  # 4 blocks x 3 sub-batches, forward and recompute
    assert_grads_close(model, ref)
    assert not inside[0] or torch.backends.cuda.flash_sdp_enabled()  # the scope is left after every run
    assert kernel_scope() is kernel_scope(sdpa="auto")  # nothing asked: no scope at all


def test_canonical_step_enters_the_scope_around_backward():
    from fsdp_speedloader.app.canonical import canonical_forward_backward

    model, entered = tiny_model("llama"), []

    class Scope:
        def __enter__(self):
            entered.append("in")

        def __exit__(self, *exc):
            entered.append("out")

    ids, labels = batch(2)
    canonical_forward_backward(model, ids, labels, sub_batch_size=2, num_tokens=int((labels[:, 1:] != -100).sum()),
                               scope=Scope)
    assert entered == ["in", "out"] * 2 and all(p.grad is not None for p in model.parameters())


# --- Liger, with stand-in kernels of the same math -----------------------------------------------------------------

def _stand_in_liger(monkeypatch) -> dict:
    """liger_kernel's three modules the binding reads, with PyTorch code of Liger's math ('llama' casting), counting
    calls; and a triton module. The binding, the scope and the engine run for real."""
    calls = {"rms_norm": 0, "swiglu": 0, "rope": 0}

    class LigerRMSNorm(torch.nn.Module):
        def forward(self, x):
            assert (self.offset, self.casting_mode, self.in_place, self.row_mode) == (0.0, "llama", False, None)
            calls["rms_norm"] += 1
            xf = x.float()
            return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)

    class LigerSwiGLUMLP(torch.nn.Module):
        def forward(self, x):
            calls["swiglu"] += 1
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        from transformers.models.llama.modeling_llama import rotate_half

        calls["rope"] += 1
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    modules = {"liger_kernel": {}, "liger_kernel.transformers": {}, "triton": {},
               "liger_kernel.transformers.rms_norm": {"LigerRMSNorm": LigerRMSNorm},
               "liger_kernel.transformers.swiglu": {"LigerSwiGLUMLP": LigerSwiGLUMLP},
               "liger_kernel.transformers.rope": {"liger_rotary_pos_emb": liger_rotary_pos_emb}}
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr("fsdp_speedloader.kernels.check_liger_kernels", lambda model, device_type: None)  # no CUDA here
    return calls


def test_liger_binding_is_per_module_and_exact(monkeypatch):
    from transformers.models.llama import modeling_llama

    calls = _stand_in_liger(monkeypatch)
    hf_rope = modeling_llama.apply_rotary_pos_emb
    model, other = tiny_model("llama"), tiny_model("llama")
    keys = list(model.state_dict())
    ids, labels = batch(3)
    _, ref = reference_grads(model, [(ids, labels)])
    apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=3, liger_kernels=True)
    assert list(model.state_dict()) == keys  # names and parameters as built: checkpoints and export unchanged
    assert "forward" not in vars(other.model.norm) and "forward" not in vars(other.model.layers[0].mlp)
    model(input_ids=ids, labels=labels).loss.backward()
    assert_grads_close(model, ref)
    runs = 2 * 4 * 3  # 4 blocks x 3 sub-batches, forward and recompute
    assert calls["rope"] == runs and calls["swiglu"] == runs
    assert calls["rms_norm"] == 2 * runs + 2 * 3  # two per block run; the final norm in the head, forward and backward
    assert modeling_llama.apply_rotary_pos_emb is hf_rope  # RoPE swapped only inside the blocks' runs
    before = dict(calls)
    other(input_ids=ids, labels=labels)  # another model in the process: Hugging Face's code throughout
    assert calls == before


# --- float8 (torchao's emulation) ----------------------------------------------------------------------------------

def test_float8_linears_run_through_the_offloaded_engine_exactly():
    """torchao's Float8Linear in the blocks (emulated: fp32 arithmetic of the float8 casts), offloaded, host store,
    one sub-batch (tensorwise scales are per tensor, so the same tensors): gradients equal the unmodified float8
    model's; the state dict keeps its names; the LM head stays a plain Linear."""
    pytest.importorskip("torchao.float8")
    from fsdp_speedloader.kernels import apply_float8_training

    model = tiny_model("llama")
    keys = list(model.state_dict())
    assert apply_float8_training(model.model.layers, "tensorwise", emulate=True) == 4 * 7
    assert list(model.state_dict()) == keys and type(model.lm_head) is torch.nn.Linear
    ids, labels = batch(1)
    _, ref = reference_grads(model, [(ids, labels)])
    apply_speedloader(copy.deepcopy(model), mesh=cpu_mesh())  # a second model must not disturb the first
    apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=1, offload_params=True, activation_store="host")
    model(input_ids=ids, labels=labels).loss.backward()
    assert_grads_close(model, ref, rtol=1e-4)


# --- the benchmark -------------------------------------------------------------------------------------------------

def test_bench_train_kernel_suffixes():
    c = bench_train.parse_contender("speedloader-overlap:2x4:root=device:keep=24:sdpa=cudnn:liger:fp8", None, True)
    assert (c.sdpa, c.liger, c.fp8, c.keep, c.compiled) == ("cudnn", True, "tensorwise", 24, True)
    c = bench_train.parse_contender("ondevice:2x4:fp8=rowwise", None)
    assert (c.sdpa, c.liger, c.fp8) == ("auto", False, "rowwise")
    for bad in ("ondevice:2x4:sdpa=flash3", "speedloader:1x8:fp8=e5m2", "speedloader:1x8:liger=1",
                "deepspeed-offload:2x4:liger"):
        with pytest.raises(ValueError, match=":liger"):
            bench_train.parse_contender(bad, None)


@pytest.mark.parametrize("version", ["0.8.1", "0.8.5", None])
def test_compiled_liger_warning_says_to_measure(version):
    """Liger in compiled blocks, any release: a warning naming the release, what was measured and what to set."""
    from fsdp_speedloader.kernels.liger import compiled_liger_warning

    message = compiled_liger_warning(version)
    assert (version or "unknown version") in message and "kernels.liger_kernels" in message and "results.md" in message
