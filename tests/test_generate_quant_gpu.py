"""Quantized generation on one GPU: the CUDA paths the CPU tests cannot reach (the weight stream's copies on the
exchange's stream and their ring buffers, the page-locked weight arena, 8-bit keys and values quantized on the
device, their D2H stores, and host attention over them).

    python -m pytest -q -m gpu tests/test_generate_quant_gpu.py

Exact tokens in fp32 (TF32 off, as tests/test_generate_gpu.py says why): against Hugging Face ``generate`` on the
same quantized model (its ``QuantizedLinear`` modules dequantizing on the fly, on the GPU), and, for the 8-bit cache,
with a cache that round-trips every key and value through the codec. Copies are delayed by ~1 ms of GPU sleep each
(``TensorExchange.copy_delay_cycles``): a missing wait shows as wrong tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from fsdp_speedloader import apply_speedloader
from fsdp_speedloader.app.config import ModelConfig
from fsdp_speedloader.generation.generate import generate
from fsdp_speedloader.models import build_model
from fsdp_speedloader.parallel import maybe_init_process_group
from fsdp_speedloader.quant import KVCodec, materialize_quantized_weights, quantize_linears_, weight_format

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB, PROMPT_LEN, NEW = 1024, 48, 16
COPY_LAG = 2_000_000  # GPU cycles (~1 ms) queued before every exchange copy


@pytest.fixture(autouse=True)
def _no_tf32():
    maybe_init_process_group("cuda")
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _model(family: str) -> torch.nn.Module:
    cfg = ModelConfig(family=family, hidden_size=256, num_layers=4, num_heads=8,
                      num_kv_heads=4 if family == "llama" else None, intermediate_size=768, vocab_size=VOCAB,
                      max_position_embeddings=512)
    return build_model(cfg, device="cpu", seed=5)


def _ids(batch: int = 8) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(0))


class _RoundTripCache(DynamicCache):
    def __init__(self, codec: KVCodec, **kwargs) -> None:
        super().__init__(**kwargs)
        self.codec = codec

    def update(self, key, value, layer_idx, *args, **kwargs):
        first = self.get_seq_length(layer_idx) == 0
        keys, values = super().update(self.codec.round_trip(key), self.codec.round_trip(value), layer_idx, *args,
                                      **kwargs)
        return (key, value) if first else (keys, values)


def _reference(model, ids, **kwargs) -> torch.Tensor:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, **kwargs).cpu()


def _lag(model) -> None:
    from fsdp_speedloader.generation.step import register_generation_methods

    resources = register_generation_methods(model)
    for exchange in (resources.weight_exchange, resources.kv_exchange):
        if exchange is not None:
            exchange.copy_delay_cycles = COPY_LAG


@pytest.mark.parametrize("family", ["llama", "opt"])
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_streamed_quantized_weights_equal_hugging_face_on_the_gpu(family, name):
    device, fmt, ids = torch.device("cuda"), weight_format(name), _ids()
    want = {}
    for offload in (True, False):  # offloaded weights are quantized on the host, resident ones on the GPU
        ref = quantize_linears_(copy.deepcopy(_model(family)), fmt).to(device)
        materialize_quantized_weights(ref, device=torch.device("cpu") if offload else device, offload=False)
        want[offload] = _reference(ref, ids.to(device))
    for offload, kv_cache, cpu, mode in ((True, "device", 0, "unit"), (True, "device", 0, "linear"),
                                         (True, "host", 0, "linear"), (True, "split", 1, "auto"),
                                         (False, "host", 2, "auto")):
        model = quantize_linears_(copy.deepcopy(_model(family)), fmt)
        apply_speedloader(model, num_sub_batches=4, offload_params=offload)
        materialize_quantized_weights(model, device=device, offload=offload)
        kwargs = dict(num_sub_batches=4, kv_cache=kv_cache, cpu_attention_sub_batches=cpu, weight_dequantize=mode)
        generate(model, ids, max_new_tokens=2, **kwargs)
        _lag(model)  # the exchanges exist after the first call
        out, stats = generate(model, ids, max_new_tokens=NEW, return_stats=True, **kwargs)
        assert torch.equal(out.cpu(), want[offload]), (offload, kv_cache, cpu, mode)
        assert stats.io["weights_dequantize"] == ("unit" if mode == "auto" else mode)  # this card has room
        assert stats.io["weights_h2d_bytes"] == (NEW * stats.io["weights_packed_bytes"] if offload else 0)


@pytest.mark.parametrize("family", ["llama", "opt"])
@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_8bit_kv_cache_equals_round_tripped_hugging_face_on_the_gpu(family, name):
    """The host cache (copied, attended on the host), the split cache and the device cache, all in 8 bits."""
    device, codec, ids = torch.device("cuda"), KVCodec(name), _ids()
    ref = copy.deepcopy(_model(family)).to(device)
    want = _reference(ref, ids.to(device), past_key_values=_RoundTripCache(codec, config=ref.config))
    for offload, kv_cache, cpu in ((True, "host", 0), (True, "host", 2), (False, "host", 4), (True, "split", 1),
                                   (True, "device", 0), (False, "device", 0)):
        model = apply_speedloader(copy.deepcopy(_model(family)), num_sub_batches=4, offload_params=offload)
        split = 2 if kv_cache == "split" else None
        generate(model, ids, max_new_tokens=2, num_sub_batches=4, kv_cache=kv_cache, kv_device_sub_batches=split,
                 kv_cache_dtype=name)
        _lag(model)
        out = generate(model, ids, max_new_tokens=NEW, num_sub_batches=4, kv_cache=kv_cache, kv_device_sub_batches=split,
                       cpu_attention_sub_batches=cpu, kv_cache_dtype=name)
        assert torch.equal(out.cpu(), want), (offload, kv_cache, cpu)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_the_fused_dequantization_equals_the_eager_kernels_on_the_gpu(name):
    """The GPU's dequantization is one ``torch.compile``d kernel: the eager kernels' weights to the last bit of
    the dtype, at a 7B linear's shapes (square, then wide: dynamic shapes), without falling back to eager."""
    from fsdp_speedloader.quant import PackedWeight, formats

    fmt, device = weight_format(name), torch.device("cuda")
    for out_features, in_features in ((4096, 4096), (11008, 4096), (4096, 11008)):
        for dtype in (torch.bfloat16, torch.float32):
            scale_shape = fmt.scale_shape(out_features, in_features)
            packed = PackedWeight(fmt, (out_features, in_features),
                                  torch.empty(fmt.code_shape(out_features, in_features), dtype=fmt.code_dtype(),
                                              device=device),
                                  torch.empty(scale_shape, dtype=dtype, device=device),
                                  torch.empty(scale_shape, dtype=dtype, device=device) if fmt.has_minimum else None)
            formats.quantize_into(torch.randn(out_features, in_features, device=device) * 0.02, packed)
            fused = packed.dequantize(dtype)
            assert formats._compiled_dequantize is not formats._dequantize_codes, "compiling fell back to eager"
            eager = formats._dequantize_codes(packed.codes, packed.scales, packed.minima, fmt.bits, fmt.group_size,
                                              dtype)
            ulp = torch.finfo(dtype).eps
            torch.testing.assert_close(fused, eager, rtol=ulp, atol=ulp * float(eager.abs().max()))


def test_auto_dequantization_takes_per_linear_when_the_gpu_memory_left_is_short():
    """'auto': a unit dequantized whole when it takes at most half of the GPU memory left, else per linear; the
    memory left read under a per-process cap (what bench_infer's --gpu-memory-gib sets)."""
    from fsdp_speedloader.engine.speedloader import speedloader_engine
    from fsdp_speedloader.generation.weight_stream import WeightStream
    from fsdp_speedloader.quant import quantized_weights

    device = torch.device("cuda", torch.cuda.current_device())  # the memory-fraction getter wants an index
    model = quantize_linears_(copy.deepcopy(_model("llama")), weight_format("int4"))
    apply_speedloader(model, num_sub_batches=4, offload_params=True)
    materialize_quantized_weights(model, device=device, offload=True)
    stream = WeightStream(quantized_weights(model), speedloader_engine(model).units, device)
    assert stream._resolve() == "unit"
    need = 2 * stream.dequantized_unit_bytes()
    total = torch.cuda.get_device_properties(device).total_memory
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    old = get_fraction(device) if get_fraction is not None else 1.0
    try:
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated(device) + need // 2) / total, device)
        assert stream._resolve() == "linear"
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated(device) + 2 * need) / total, device)
        assert stream._resolve() == "unit"
    finally:
        torch.cuda.set_per_process_memory_fraction(old, device)
