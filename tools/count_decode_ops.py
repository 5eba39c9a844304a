"""PyTorch ops per decoding step and layer, by KV-cache mode and weight format, on the CPU.

A GPU decoding step of many small groups is bound by what the host issues per group, not by FLOPs or bytes: every
op that launches a kernel costs microseconds of host time. This counts the ``aten::`` ops of a decoding step
(the profiler's events of a 4-token generation minus a 2-token one, halved) for a tiny LLaMA (4 layers, hidden
128, 64 sequences in ``--num-sub-batches`` sub-batches) under each configuration, per layer. With the whole cache
on the device a decoding step runs the whole batch through each layer as one group (``whole_batch_decode``);
otherwise each sub-batch is a group of its own. The counts do not depend on the model's size, so they carry over
to a 70B decode of the same schedule. ::

    python tools/count_decode_ops.py --out bench/results/decode_ops_per_layer.json

Configurations (``--config``, repeatable; default all): ``device`` (the whole KV cache on the device),
``device-int4`` (int4 weights), ``split`` (4 groups' cache on the device, the rest in host memory, 6 of those
attended on the CPU), ``split-int4-kv8`` (that, with int4 weights and the host cache in int8: the LLaMA-2-70B
benchmark's ``speedloader:256x16:split=4:cpu=6:w=int4:kvq=int8``).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
import harness  # noqa: E402

CONFIGS = {  # name: (weight format or None, kv_cache, 8-bit host cache or None, cpu attention groups)
    "device": (None, "device", None, 0),
    "device-int4": ("int4", "device", None, 0),
    "split": (None, "split", None, 6),
    "split-int4-kv8": ("int4", "split", "int8", 6),
}
LAYERS, BATCH, PROMPT = 4, 64, 32


def _model(weight_format: str | None, num_sub_batches: int):
    from fsdp_speedloader import apply_speedloader
    from fsdp_speedloader.models import ModelConfig, build_model
    from fsdp_speedloader.models.build import _rebuild_buffers
    from fsdp_speedloader.quant import materialize_quantized_weights, quantize_linears_, weight_format as fmt

    cfg = ModelConfig(name="decode_ops", hidden_size=128, num_layers=LAYERS, num_heads=4, num_kv_heads=2,
                      intermediate_size=256, vocab_size=320, max_position_embeddings=256)
    model = build_model(cfg, device="meta").to(torch.bfloat16)
    if weight_format:
        quantize_linears_(model, fmt(weight_format))
    apply_speedloader(model, num_sub_batches=num_sub_batches, offload_params=False, activation_store="device")
    model.to_empty(device="cpu")
    _rebuild_buffers(model, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    if weight_format:
        materialize_quantized_weights(model, device=torch.device("cpu"), offload=False, dummy=True)
    return model


def count(name: str, num_sub_batches: int) -> dict:
    from fsdp_speedloader.generation.generate import generate

    weight_format, kv_cache, kv_dtype, cpu = CONFIGS[name]
    model = _model(weight_format, num_sub_batches)
    ids = torch.randint(0, 320, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    kwargs = dict(num_sub_batches=num_sub_batches, kv_cache=kv_cache, eos_token_id=None,
                  cpu_attention_sub_batches=cpu, kv_cache_dtype=kv_dtype)
    if kv_cache == "split":
        kwargs["kv_device_sub_batches"] = 4
    generate(model, ids, max_new_tokens=2, **kwargs)  # warm-up: lazy set-up is not a decoding step

    def ops(new_tokens: int) -> collections.Counter:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            generate(model, ids, max_new_tokens=new_tokens, **kwargs)
        return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))

    two, four = ops(2), ops(4)
    step = {k: (four[k] - two.get(k, 0)) / 2 for k in four}
    top = sorted(step.items(), key=lambda kv: -kv[1])[:12]
    return {"config": name, "num_sub_batches": num_sub_batches, "ops_per_decoding_step": sum(step.values()),
            "ops_per_layer": sum(step.values()) / LAYERS, "top_ops_per_layer": {k: v / LAYERS for k, v in top}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", choices=sorted(CONFIGS), help="repeatable; default all")
    p.add_argument("--num-sub-batches", type=int, default=16)
    p.add_argument("--out", default=None, help="write a JSON record here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from fsdp_speedloader.parallel import maybe_init_process_group

    maybe_init_process_group("cpu")
    rows = [count(name, args.num_sub_batches) for name in (args.config or CONFIGS)]
    for r in rows:
        print(f"{r['config']:>15}: {r['ops_per_decoding_step']:7.0f} aten ops per decoding step, "
              f"{r['ops_per_layer']:7.1f} per layer")
    if args.out:
        record = {**harness.record_header("decode_ops", __file__, argv, device="cpu (op counts)"),
                  "model": {"layers": LAYERS, "batch": BATCH, "prompt": PROMPT}, "results": rows}
        print("wrote", harness.write_record(args.out, record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
