"""Quantized generation: weights kept group-wise int8 / int4 and streamed packed, keys and values in 8 bits.

    formats.py   the group-wise weight formats: quantize, dequantize, dummy fill
    linear.py    QuantizedLinear, and quantize_linears_ (every block linear, before apply_speedloader)
    weights.py   where the packed weights live: one buffer per block, host arena or GPU
    load.py      materialize_quantized_weights: quantized while loading (checkpoint, seed, or dummy)
    kv.py        8-bit keys and values (int8 / fp8 e4m3) with per-token, per-head scales

Usage (generation; docs/generation.md)::

    model = build_model(cfg, device="meta").to(torch.bfloat16)
    quantize_linears_(model, weight_format("int4"))
    apply_speedloader(model, num_sub_batches=8, offload_params=True)
    materialize_model(model, cfg, device=device, seed=0, param_device=torch.device("cpu"))
    materialize_quantized_weights(model, device=device, offload=True, path=cfg.path)
    generate(model, ids, max_new_tokens=32, num_sub_batches=8, kv_cache="split", kv_cache_dtype="int8")
"""

from fsdp_speedloader.quant.formats import DEFAULT_GROUP_SIZE, WEIGHT_FORMATS, PackedWeight, WeightFormat, \
    dequantize, weight_format
from fsdp_speedloader.quant.kv import KV_CACHE_DTYPES, KVCodec, kv_codec
from fsdp_speedloader.quant.linear import QuantizedLinear, quantize_linears_, quantized_linears
from fsdp_speedloader.quant.load import materialize_quantized_weights
from fsdp_speedloader.quant.weights import BlockWeights, QuantizedWeights, quantized_weights

__all__ = ["BlockWeights", "DEFAULT_GROUP_SIZE", "KVCodec", "KV_CACHE_DTYPES", "PackedWeight", "QuantizedLinear",
           "QuantizedWeights", "WEIGHT_FORMATS", "WeightFormat", "dequantize", "kv_codec",
           "materialize_quantized_weights", "quantize_linears_", "quantized_linears", "quantized_weights",
           "weight_format"]
