"""Offloaded generation throughput on one GPU under one GPU-memory budget: speedloader vs accelerate vs FlexGen
vs DeepSpeed ZeRO-Inference.

Every contender runs in its own process (fresh CUDA context, ``torch.cuda.set_per_process_memory_fraction``
set to the same ``--gpu-memory-gib``), on the same model shape (``conf/model/<model>.yaml``, dummy
weights: nothing is downloaded), prompt length and generation length, and generates EVERY token
(no projected timings, no EOS stop). A contender that fails or times out is recorded as such.

  speedloader:BxN[:kv][:cpu=C][:w=Q][:kvq=K][:deq=D]
                         this project: B prompts in N sub-batches; weights offloaded to the host when they
                         take more than half the budget (--offload to force), KV cache 'auto' (default),
                         'host', 'device', 'split', 'split=D' (the last D sub-batches on the GPU) or 'off';
                         cpu=C: the first C host sub-batches attend on the CPU (cpu_attention_sub_batches);
                         w=int8|int4: block linears group-wise quantized (dummy codes, nothing computed), streamed
                         packed and dequantized on the GPU per unit; kvq=int8|fp8: the KV cache in 8 bits (GPU and host);
                         deq=auto|unit|linear: generate's weight_dequantize (default auto)
  accelerate:B           Hugging Face generate on a model dispatched by accelerate (device_map from
                         infer_auto_device_map with max_memory: the budget minus B's KV cache and a margin
                         on the GPU, the rest of the layers on the host)
  flexgen[:GBSxNGBS][:c4|:kc4][:w=P][:attn=cpu|gpu]
                         FlexGen 0.1.8 (OPT only), dummy weights, its published policy for the model
                         (FLEXGEN_POLICIES; --flexgen-percent / --flexgen-cpu-cache-compute override); c4: its
                         4-bit group-wise compression of the weights and the KV cache, kc4: of the cache only (its
                         published OPT-30B setting with compression), fp16 without; w=P: P% of the weights on the
                         GPU, the rest on the host; attn: attention over the cache on the CPU or the GPU
                         (flexgen_policy)
  zero-inference:B[:q4|:q8][:fp16|:bf16]
                         DeepSpeed ZeRO-Inference: ZeRO-3 with every parameter partitioned to page-locked host
                         memory and gathered to the GPU module by module for each forward, Hugging Face generate
                         (a mixture of experts' sparse blocks as ZeRO-3 leaf modules: one gather per layer);
                         q4 / q8: its weight quantization (quantized_initialization: group 64, asymmetric, every
                         nn.Linear and nn.Embedding, dequantized at each use), in fp16 by default (its published
                         setting and its CUDA dequantization kernel; bf16 runs its PyTorch fallback). Its KV
                         offload needs a patched transformers 4.x fork and is not carried

``--model`` is any shape of ``conf/model/`` (opt_30b, llama2_13b, llama3_8b, mixtral_8x7b, ...). A contender that
cannot run the model is not launched: its row says ``status: unsupported`` and why (FlexGen implements OPT
only). A mixture of experts runs ``--experts-implementation`` (default grouped_mm) in every contender, in the
prefill and in decoding alike: Hugging Face's generate would otherwise switch grouped_mm to batched_mm for
decoding (which copies each routed token's expert weights: gigabytes per layer at these shapes); the row
records the kernel.

Usage (the paper's setting, one GPU, 24 GiB budget)::

    pip download flexgen==0.1.8 --no-deps -d .whl          # once, where the package index is reachable
    python tools/bench_infer.py --model opt_30b --gpu-memory-gib 24 --prompt-len 512 --gen-len 32 \\
        --contender speedloader:104x8:split=2:cpu=6 --contender flexgen:32x2 --contender accelerate:16 \
        --name infer_opt30b_24g        # with FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB=125 on a 128 GiB host

``--layers L`` runs every contender on the model's first L layers' shape (a quicker look at a decoding step's
per-layer schedule); ``--profile`` traces one more speedloader generation of up to 4 tokens and records where
its host-to-device copies ran relative to the CPU's attention (``summarize_decode_trace``)::

    python tools/bench_infer.py --model opt_30b --layers 8 --offload yes --profile --contender speedloader:104x8:split=2:cpu=6

FlexGen's dependencies besides torch/transformers/numpy: tqdm, attrs (pulp only for its cost model,
not imported here). Its wheel is unpacked into a temporary directory and imported from there; its
tokenizer (downloaded from the Hub in its own driver) is not used: the prompts are token ids.

Writes bench/results/<name>.json (device, torch version, commit, command line, configuration, every
figure) and prints a markdown table. Generated tokens/s = B x gen_len / (prefill + decode time),
FlexGen's "total throughput".
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
import harness  # noqa: E402

REPO = harness.REPO
MODELS = tuple(harness.conf_model_names())  # opt_6.7b, opt_30b, llama2_13b, llama3_8b, mixtral_8x7b, ...
# FlexGen's own policies at prompt 512 / gen 32 (its benchmark suite): percent = weights GPU/CPU,
# cache GPU/CPU, activations GPU/CPU. OPT-6.7B fits the budget on the GPU; the batch fills the rest.
FLEXGEN_POLICIES = {
    "opt_6.7b": dict(percent=[100, 0, 100, 0, 100, 0], gpu_batch_size=24, num_gpu_batches=1, cpu_cache_compute=False),
    "opt_30b": dict(percent=[20, 80, 0, 100, 0, 100], gpu_batch_size=48, num_gpu_batches=3, cpu_cache_compute=True),
}
FLEXGEN_NAMES = {"opt_6.7b": "facebook/opt-6.7b", "opt_30b": "facebook/opt-30b"}
FLEXGEN_COMPRESSION = {"fp16": (False, False), "c4": (True, True), "kc4": (False, True)}  # (weights, cache)


def flexgen_policy(model: str, spec: str) -> dict:
    """FlexGen's policy for ``flexgen:SPEC`` on ``model``: its published one (FLEXGEN_POLICIES), the batch from the
    spec's GBSxNGBS, the compression (``c4`` weights and cache, ``kc4`` the cache only), ``w=P`` P% of the weights
    on the GPU and the rest on the host, ``attn=cpu|gpu`` where attention over the cache runs. A compressed cache
    attended on the CPU is decompressed there by FlexGen's PyTorch code: its own compressed settings attend on
    the GPU."""
    pol = dict(FLEXGEN_POLICIES[model], compress_weight=False, compress_cache=False)
    shape, *options = spec.split(":") if spec else [""]
    if shape:
        pol["gpu_batch_size"], pol["num_gpu_batches"] = (int(v) for v in shape.split("x"))
    modes = [o for o in options if o in FLEXGEN_COMPRESSION]
    unknown = [o for o in options if o not in FLEXGEN_COMPRESSION and not re.fullmatch(r"w=\d+|attn=(cpu|gpu)", o)]
    if unknown or len(modes) > 1:
        raise ValueError(f"flexgen:{spec}: {'unknown option(s) ' + str(unknown) if unknown else 'two compressions'}; "
                         "one of ':c4' (weights and KV cache to 4 bits, FlexGen's group-wise quantization), ':kc4' "
                         "(the cache only), ':fp16' (default: neither); ':w=P' puts P% of the weights on the GPU; "
                         "':attn=cpu|gpu' where attention over the cache runs")
    pol["compress_weight"], pol["compress_cache"] = FLEXGEN_COMPRESSION[modes[0] if modes else "fp16"]
    for option in options:
        key, _, value = option.partition("=")
        if key == "w":
            if not 0 <= int(value) <= 100:
                raise ValueError(f"flexgen:{spec}: w={value} is a percentage of the weights on the GPU (0-100)")
            pol["percent"] = [int(value), 100 - int(value), *pol["percent"][2:]]
        elif key == "attn":
            pol["cpu_cache_compute"] = value == "cpu"
    return pol


# --- shared helpers ------------------------------------------------------------------------------


def _model_config(args):
    # --layers: the same layers, fewer of them (a decoding step's per-layer schedule, quicker to load)
    return harness.model_config(args.model, layers=args.layers, min_positions=args.prompt_len + args.gen_len)


def unsupported_reason(contender: str, cfg) -> str | None:
    """Why ``contender`` (its name) cannot run the model ``cfg``, or None when it can."""
    if contender == "flexgen" and (cfg.family != "opt" or cfg.name not in FLEXGEN_POLICIES):
        return (f"FlexGen 0.1.8 implements OPT only (its own OPT model, flex_opt.py, with published policies for "
                f"{', '.join(sorted(FLEXGEN_POLICIES))}); {cfg.name} is a {cfg.family} model")
    return None


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()  # alloc_retries counts the timed run only


def _peak_hbm_gib(device, reserved: bool = False) -> float:
    import torch

    if device.type != "cuda":
        return 0.0
    return (torch.cuda.max_memory_reserved() if reserved else torch.cuda.max_memory_allocated()) / 2**30


def _same_experts_throughout(model, args) -> str | None:
    """A mixture of experts: ``--experts-implementation`` for the prefill AND decoding (transformers' generate
    switches grouped_mm to batched_mm for decoding on a GPU; that switch is turned off here); returns the kernel,
    None for a dense model."""
    import contextlib

    experts = harness.set_experts_implementation(model, args.experts_implementation)
    if experts is not None and hasattr(model, "_optimize_model_for_decode"):
        model._optimize_model_for_decode = contextlib.nullcontext  # an instance attribute: generate finds it first
    return experts


def _cap_gpu(args):
    import torch

    if args.device == "cpu":  # a check of the code path only
        return torch.device("cpu")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * 2**30 / total), device)
    return device


def _prompts(args, batch: int, vocab: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(4, vocab, (batch, args.prompt_len), generator=gen)


_DUMMY_CHUNK = 1 << 24  # values per host task of _dummy_init


def _dummy_init(params) -> None:
    """Small uniform values in place (the throughput does not depend on them). Host tensors in chunks on every host
    thread, a generator per chunk: CPU ``uniform_`` runs on one thread (340 M values/s on this project's CPU
    machine: ~90 s for OPT-30B's 30 B values, inside the bf16 rows' set-up)."""
    import torch

    from fsdp_speedloader.memory.threads import run_on_host_threads

    def fill(chunk, seed: int) -> None:
        chunk.uniform_(-0.02, 0.02, generator=torch.Generator().manual_seed(seed))

    tasks = []
    for p in params:
        local = (p.to_local() if hasattr(p, "to_local") else p).detach()  # detached: filled in place off grad mode
        if not (local.is_floating_point() and local.numel()):
            continue
        if local.device.type != "cpu" or not local.is_contiguous():
            local.uniform_(-0.02, 0.02)
            continue
        flat = local.view(-1)
        tasks += [functools.partial(fill, flat[i:i + _DUMMY_CHUNK], len(tasks) + k)
                  for k, i in enumerate(range(0, flat.numel(), _DUMMY_CHUNK))]
    run_on_host_threads(tasks)


def _spans(events: list, name: str, cat: str | None = None) -> list:
    """Host spans of a ``record_function`` (``cat='user_annotation'``: not its copy on the GPU's timeline)."""
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("name") == name
                  and (cat is None or e.get("cat") == cat))


def summarize_decode_trace(path: str) -> dict:
    """The decoding steps of one traced generation. With attention on the host: does the link copy while the
    CPU attends? From the first host attention to the last, the host-to-device copies' bytes inside and
    outside the CPU's attention windows (``speedloader::host_attention``; a copy that straddles a window's
    edge counts pro rata) and their rates, and the host's time waiting for the GPU's queries. Without: from
    the first decoding step (``speedloader::decode_step``) to the GPU's last work, the link's bytes and rate,
    the host's time issuing the steps, and where the time goes."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    attend = _spans(events, "speedloader::host_attention")  # one thread: the windows do not overlap
    if not attend:  # the cache on the device: the decoding steps' host spans, to the end of the GPU's work
        steps = _spans(events, "speedloader::decode_step", "user_annotation")
        if not steps:
            return {"error": "no decoding step in the trace"}
        lo = steps[0][0]
        hi = max(e["ts"] + e["dur"] for e in events if e.get("ph") == "X" and e["ts"] >= lo)
        h2d = sum(e.get("args", {}).get("bytes", 0) for e in events if e.get("ph") == "X"
                  and e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "") and lo <= e["ts"] < hi)
        return {"span_s": (hi - lo) / 1e6, "decode_steps": len(steps),
                "host_issue_s": sum(y - x for x, y in steps) / 1e6,  # the host's time inside the steps' calls
                "h2d_gb": h2d / 1e9, "h2d_GBps": h2d / 1e3 / (hi - lo), **where_time_goes(events, lo, hi)}
    lo, hi = attend[0][0], attend[-1][1]
    copies = [(e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("bytes", 0)) for e in events
              if e.get("ph") == "X" and e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")
              and lo <= e["ts"] < hi]
    inside = sum(n * sum(max(0.0, min(b, y) - max(a, x)) for x, y in attend) / (b - a) for a, b, n in copies if b > a)
    total = sum(n for _, _, n in copies)
    span_s, attend_s = (hi - lo) / 1e6, sum(y - x for x, y in attend) / 1e6
    return {"span_s": span_s, "cpu_attention_s": attend_s,
            "cpu_attention_wait_s": sum(y - x for x, y in _spans(events, "speedloader::host_attention_wait")
                                        if lo <= x < hi) / 1e6,
            "h2d_gb": total / 1e9, "h2d_gb_during_cpu_attention": inside / 1e9,
            "h2d_GBps_during_cpu_attention": inside / 1e9 / attend_s if attend_s else None,
            "h2d_GBps_otherwise": (total - inside) / 1e9 / (span_s - attend_s) if span_s > attend_s else None,
            **where_time_goes(events, lo, hi)}


def where_time_goes(events: list, lo: float, hi: float, top: int = 12) -> dict:
    """Between ``lo`` and ``hi`` (trace microseconds): the GPU's busy fraction (kernels and copies, merged), the
    kernels and the host's ``aten::`` ops with the most total time, and the kernel launches per second: what
    bounds a decoding step when it is neither the link nor the host's attention."""
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X"
                 and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and lo <= e["ts"] < hi)
    busy, end = 0.0, lo
    for a, b in gpu:  # the union of the GPU's intervals (copies overlap kernels)
        a = max(a, end)
        if b > a:
            busy, end = busy + b - a, b
    def totals(cat: str, prefix: str = "") -> list:
        t: dict = {}
        for e in events:
            if e.get("ph") == "X" and e.get("cat") == cat and lo <= e["ts"] < hi and e["name"].startswith(prefix):
                t[e["name"]] = t.get(e["name"], 0.0) + e["dur"]
        return [{"name": k[:120], "s": v / 1e6} for k, v in sorted(t.items(), key=lambda kv: -kv[1])[:top]]
    launches = sum(1 for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
                   and "Launch" in e.get("name", "") and lo <= e["ts"] < hi)
    span = (hi - lo) / 1e6
    return {"gpu_busy_fraction": busy / (hi - lo) if hi > lo else None, "kernel_launches_per_s": launches / span,
            "top_kernels": totals("kernel"), "top_host_ops": totals("cpu_op", "aten::")}


def _kv_bytes(cfg, batch: int, positions: int) -> int:
    kv_heads = cfg.num_kv_heads or cfg.num_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_heads  # Qwen3, Gemma-3 set their own
    return 2 * batch * cfg.num_layers * positions * kv_heads * head_dim * 2


# --- contenders (each runs in a worker process) --------------------------------------------------


def run_speedloader(args, spec: str) -> dict:
    import torch
    from torch.distributed.fsdp import FSDPModule

    from fsdp_speedloader import apply_speedloader
    from fsdp_speedloader.generation.generate import generate
    from fsdp_speedloader.models import build_model, get_adapter
    from fsdp_speedloader.models.build import _rebuild_buffers
    from fsdp_speedloader.parallel import maybe_init_process_group

    shape, *options = spec.split(":")
    batch, num_sub = (int(v) for v in shape.split("x"))
    on_cpu = sum(int(o.partition("=")[2]) for o in options if o.startswith("cpu="))
    quant = {k: v for k, _, v in (o.partition("=") for o in options) if k in ("w", "kvq", "deq")}  # issue 21
    options = [o for o in options if o.partition("=")[0] not in ("w", "kvq", "deq")]
    kv_cache, _, on_device = (([o for o in options if not o.startswith("cpu=")] or ["auto"])[0]).partition("=")
    maybe_init_process_group(args.device)
    device = _cap_gpu(args)
    cfg = _model_config(args)
    model = build_model(cfg, device="meta").to(torch.bfloat16)  # inference: no fp32 master weights
    experts = harness.set_experts_implementation(model, args.experts_implementation)  # its own generate: no switch
    if "w" in quant:  # the block linears become packed int8 / int4 (filled below, after sharding)
        from fsdp_speedloader.quant import quantize_linears_, quantized_linears, weight_format

        quantize_linears_(model, weight_format(quant["w"]))
    weight_bytes = (sum(p.numel() for p in model.parameters()) * 2
                    + sum(m.format.nbytes(m.out_features, m.in_features, torch.bfloat16)
                          for _, m in (quantized_linears(model) if "w" in quant else ())))
    offload = args.offload == "yes" or (args.offload == "auto" and weight_bytes > 0.5 * args.gpu_memory_gib * 2**30)
    apply_speedloader(model, num_sub_batches=num_sub, offload_params=offload,
                      activation_store="host" if offload else "device", forward_prefetch=args.prefetch)
    # Untouched host pages until the first step moves the shards into the store's page-locked arena:
    # the weights are never held twice (an init before the move would double the host memory).
    model.to_empty(device=torch.device("cpu") if offload else device)
    _rebuild_buffers(model, device)
    if "w" in quant:  # a byte pattern and constant scales: no bf16 weight exists, nothing is quantized
        from fsdp_speedloader.quant import materialize_quantized_weights

        materialize_quantized_weights(model, device=device, offload=offload, dummy=True)
    ids = _prompts(args, batch, cfg.vocab_size)
    kwargs = dict(num_sub_batches=num_sub, kv_cache=kv_cache, eos_token_id=None,
                  kv_device_sub_batches=int(on_device) if on_device else None, cpu_attention_sub_batches=on_cpu,
                  kv_cache_dtype=quant.get("kvq"), weight_dequantize=quant.get("deq", "auto"))
    # Warm-up: lazy init, arenas (the longest geometry first, so the timed run re-plans nothing).
    warm = torch.cat([ids, ids[:, : args.gen_len - 1]], dim=1) if args.gen_len > 1 else ids
    generate(model, warm, max_new_tokens=1, **kwargs)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    _dummy_init(model.parameters())
    _sync(device)
    _reset_peak(device)
    t0 = time.perf_counter()
    out, stats = generate(model, ids, max_new_tokens=args.gen_len, return_stats=True, **kwargs)
    wall = time.perf_counter() - t0
    assert out.shape == (batch, args.prompt_len + args.gen_len)
    adapter = get_adapter(model)
    block_bytes = sum(p.numel() for b in adapter.blocks for p in b.parameters()) * 2
    h, layers = cfg.hidden_size, len(adapter.blocks)
    units = layers  # blocks_per_unit 1
    io = {
        # Quantized: the packed bytes the weight stream copied, and the blocks' remaining (bf16) parameters.
        "weights_h2d_bytes": (block_bytes * args.gen_len if offload else 0) + stats.io.get("weights_h2d_bytes", 0),
        "kv_h2d_bytes": stats.io.get("kv_h2d_bytes", 0), "kv_d2h_bytes": stats.io.get("kv_d2h_bytes", 0),
        # Read by attention on the CPU from host memory (never crosses the link); its queries and outputs do.
        "kv_cpu_attention_read_bytes": stats.io.get("kv_cpu_attention_read_bytes", 0),
        # Block-boundary activations cross the link twice per unit (store + fetch) when the store is on the host.
        "activation_bytes": (2 * units * batch * h * 2 * (args.prompt_len + args.gen_len - 1)) if offload else 0,
        # Host seconds of those attentions: waiting for the GPU's query, and computing (cpu_attention_*).
        **{k: v for k, v in stats.io.items() if k.startswith("cpu_attention_")},
    }
    def traced() -> None:  # one more, shorter generation (the timed one is not): where the link's copies happen
        generate(model, ids, max_new_tokens=min(args.gen_len, 4), **kwargs)
        _sync(device)

    profile = harness.profile_summary(traced, lambda trace, _: summarize_decode_trace(trace)) if args.profile else None
    return {"batch_size": batch, "num_sub_batches": num_sub, "kv_cache": stats.kv_cache, "offload_weights": offload,
            "experts_implementation": experts, "weight_quant": quant.get("w"), "kv_cache_dtype": quant.get("kvq"),
            "weights": {k: v for k, v in stats.io.items() if k.startswith("weights_")},
            "kv_host_bytes": stats.io.get("kv_host_bytes"),
            "forward_prefetch": args.prefetch, "num_layers": layers, "profile": profile,
            "kv_device_sub_batches": stats.io.get("kv_device_sub_batches"),
            "cpu_attention_sub_batches": stats.io.get("kv_cpu_attention_sub_batches", 0),
            "prefill_s": stats.prefill_s, "decode_s": stats.decode_s, "wall_s_generate": wall,
            "generated_tokens_per_s": stats.generated_tokens_per_s, "prefill_tokens_per_s": stats.prefill_tokens_per_s,
            "decode_tokens_per_s": stats.decode_tokens_per_s, "io": io, "kv_cache_bytes": stats.io.get("kv_cache_bytes", 0),
            "peak_hbm_gib": _peak_hbm_gib(device),
            "peak_hbm_reserved_gib": _peak_hbm_gib(device, reserved=True), "host_peak_rss_gib": harness.host_peak_rss_gib(),
            # The timed run's cudaMalloc retries (the caching allocator freed its cache to fit): > 0 near the cap.
            "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0}


def run_accelerate(args, spec: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_speedloader.models import build_hf_config, get_adapter
    from fsdp_speedloader.models.build import _rebuild_buffers

    batch = int(spec)
    device = _cap_gpu(args)
    cfg = _model_config(args)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_hf_config(cfg), dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty unties shared tensors (OPT's embedding and LM head)
    _rebuild_buffers(model, torch.device("cpu"))
    _dummy_init(model.parameters())
    model.eval()
    experts = _same_experts_throughout(model, args)
    block_cls = type(get_adapter(model).blocks[0]).__name__
    kv = _kv_bytes(cfg, batch, args.prompt_len + args.gen_len)
    gpu_weights = int(args.gpu_memory_gib * 2**30 - kv - args.accelerate_margin_gib * 2**30)
    if gpu_weights <= 0:
        raise RuntimeError(f"batch {batch}: its KV cache ({kv / 2**30:.1f} GiB) leaves no GPU memory for weights")
    if device.type == "cuda":
        from accelerate import dispatch_model, infer_auto_device_map

        device_map = infer_auto_device_map(model, max_memory={0: gpu_weights, "cpu": int(args.host_memory_gib * 2**30)},
                                           no_split_module_classes=[block_cls], dtype=torch.bfloat16)
        model = dispatch_model(model, device_map=device_map)
    else:  # the CPU check: no GPU to dispatch to
        device_map = {"": "cpu"}
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 1
    ids = _prompts(args, batch, cfg.vocab_size).to(device)
    model.generate(input_ids=ids[:, :8], max_new_tokens=2, do_sample=False)  # warm-up
    _sync(device)
    _reset_peak(device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, max_new_tokens=1, do_sample=False)
    _sync(device)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, max_new_tokens=args.gen_len, do_sample=False)
    _sync(device)
    total = time.perf_counter() - t0
    assert out.shape == (batch, args.prompt_len + args.gen_len)
    on_gpu = sum(1 for v in device_map.values() if v in (0, "cuda", "cuda:0"))
    return {"batch_size": batch, "experts_implementation": experts,
            "prefill_s": prefill, "decode_s": max(total - prefill, 0.0),
            "generated_tokens_per_s": batch * args.gen_len / total,
            "prefill_tokens_per_s": batch * args.prompt_len / prefill,
            "decode_tokens_per_s": batch * (args.gen_len - 1) / max(total - prefill, 1e-9),
            "gpu_weight_budget_gib": gpu_weights / 2**30, "device_map_entries_on_gpu": on_gpu,
            "device_map_entries": len(device_map), "peak_hbm_gib": _peak_hbm_gib(device),
            "host_peak_rss_gib": harness.host_peak_rss_gib(),
            "note": "full generate timed; prefill timed separately as a 1-token generate"}


def run_flexgen(args, spec: str) -> dict:
    if args.model not in FLEXGEN_POLICIES:
        raise RuntimeError(f"FlexGen 0.1.8 runs OPT models only; {args.model} is not supported")
    wheel = Path(args.flexgen_wheel)
    if not wheel.is_file():
        raise RuntimeError(f"FlexGen wheel not found at {wheel}; run `pip download flexgen==0.1.8 --no-deps -d .whl`")
    src = tempfile.mkdtemp(prefix="flexgen_")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(src)
    sys.path.insert(0, src)
    import numpy as np
    import torch
    from flexgen.compression import CompressionConfig
    from flexgen.flex_opt import OptLM, Policy, get_opt_config
    from flexgen.pytorch_backend import TorchDevice, TorchDisk, TorchMixedDevice
    from flexgen.timer import timers
    from flexgen.utils import ExecutionEnv

    _cap_gpu(args)
    pol = flexgen_policy(args.model, spec)
    if args.flexgen_percent:
        pol["percent"] = [int(v) for v in args.flexgen_percent.split()]
    if args.flexgen_cpu_cache_compute is not None:
        pol["cpu_cache_compute"] = args.flexgen_cpu_cache_compute == "yes"
    gpu, cpu = TorchDevice("cuda:0"), TorchDevice("cpu")
    disk = TorchDisk(tempfile.mkdtemp(prefix="flexgen_offload_"))
    env = ExecutionEnv(gpu=gpu, cpu=cpu, disk=disk, mixed=TorchMixedDevice([gpu, cpu, disk]))
    comp = dict(num_bits=4, group_size=64, symmetric=False)  # FlexGen's own (group 64, asymmetric)
    policy = Policy(pol["gpu_batch_size"], pol["num_gpu_batches"], *pol["percent"], True, True, True,
                    pol["cpu_cache_compute"], 1.0, pol["compress_weight"], CompressionConfig(group_dim=0, **comp),
                    pol["compress_cache"], CompressionConfig(group_dim=2, **comp))
    opt_config = get_opt_config(FLEXGEN_NAMES[args.model])
    if args.layers:
        opt_config.num_hidden_layers = args.layers
    batch = pol["gpu_batch_size"] * pol["num_gpu_batches"]
    ids = _prompts(args, batch, opt_config.vocab_size).numpy().astype(np.int64)
    try:
        model = OptLM(opt_config, env, "_DUMMY_", policy)  # "_DUMMY_" in the path: dummy weights, no download
        model.generate([list(r[:32]) for r in ids], max_new_tokens=1)  # warm-up, as FlexGen's driver
        timers("generate").reset()
        t0 = time.perf_counter()
        out = model.generate([list(r) for r in ids], max_new_tokens=args.gen_len)
        wall = time.perf_counter() - t0
        costs = timers("generate").costs
    finally:
        env.close_copy_threads()
    assert out.shape == (batch, args.prompt_len + args.gen_len)
    prefill, decode = costs[0], sum(costs[1:])
    compression = {(True, True): "4-bit weights and cache", (False, True): "4-bit cache", (False, False): "fp16"}
    return {"batch_size": batch, "policy": pol,
            "compression": compression[pol["compress_weight"], pol["compress_cache"]],
            "prefill_s": prefill, "decode_s": decode, "wall_s_generate": wall,
            "generated_tokens_per_s": batch * args.gen_len / (prefill + decode),
            "prefill_tokens_per_s": batch * args.prompt_len / prefill,
            "decode_tokens_per_s": batch * (args.gen_len - 1) / max(decode, 1e-9),
            "peak_hbm_gib": torch.cuda.max_memory_allocated() / 2**30, "host_peak_rss_gib": harness.host_peak_rss_gib()}


def zero_inference_config(block_numel: int, budget_bytes: int) -> dict:
    """ZeRO-Inference's DeepSpeed config: ZeRO-3, every parameter partitioned to page-locked host memory (its
    published setting; its weight quantization is added by run_zero_inference's q4 / q8, its KV offload needs a
    patched transformers and is not carried), bf16, prefetching one block ahead, at most two blocks (or what half the budget holds) gathered at
    once; parameters under 1e5 elements (norm scales) stay on the GPU."""
    live = max(2 * block_numel, min(budget_bytes // 4, 8 * block_numel))  # bf16: half the budget / 2 bytes
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                  "stage3_prefetch_bucket_size": block_numel,
                                  "stage3_max_live_parameters": live, "stage3_max_reuse_distance": live,
                                  "stage3_param_persistence_threshold": int(1e5)}}


def run_zero_inference(args, spec: str) -> dict:
    """DeepSpeed ZeRO-Inference (ZeRO-3 parameter offload) with Hugging Face generate: every forward gathers
    each module's parameters from the host (a mixture of experts' sparse block at once: a ZeRO-3 leaf module)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/fsl_torch_extensions")
    # DeepSpeed's op builder reads TORCH_CUDA_ARCH_LIST entries as numbers: an arch-specific one ('9.0a', which
    # the GPU image sets) stops its JIT build of the dequantization kernel; the plain target ('9.0') builds.
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch:
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(
            re.sub(r"(\d+\.\d+)[a-z]+", r"\1", a) for a in arch.replace(" ", ";").split(";") if a)
    try:
        import deepspeed
    except ImportError as exc:
        raise SystemExit(f"zero-inference: deepspeed not installed ({exc}); build the wheels with "
                         "tools/build_deepspeed_wheels.sh and install them") from None
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from bench_deepspeed import mark_moe_leaf_modules, moe_blocks
    from launch_two_nodes import free_port

    from fsdp_speedloader.models import build_hf_config, build_model, get_adapter

    batch, *flags = spec.split(":")
    batch = int(batch)
    bits = {"q4": 4, "q8": 8}.get(next((f for f in flags if f in ("q4", "q8")), ""))  # issue 21: its quantization
    dtype = torch.float16 if "fp16" in flags or (bits and "bf16" not in flags) else torch.bfloat16
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    device = _cap_gpu(args)
    cuda = device.type == "cuda"
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    cfg = _model_config(args)
    meta = get_adapter(build_model(cfg))  # sizes only, before ZeRO-3's Init is enabled
    block_numel = sum(p.numel() for p in meta.blocks[0].parameters())
    del meta
    kv = _kv_bytes(cfg, batch, args.prompt_len + args.gen_len)
    ds_config = zero_inference_config(block_numel, int(args.gpu_memory_gib * 2**30) - kv)
    if not cuda:
        ds_config["zero_optimization"]["offload_param"]["pin_memory"] = False
    if dtype == torch.float16:
        ds_config["bf16"], ds_config["fp16"] = {"enabled": False}, {"enabled": True}
    if bits:  # DeepSpeedExamples' zero_inference run_model.py setting: every nn.Linear / nn.Embedding at init
        ds_config["weight_quantization"] = {"quantized_initialization": {
            "num_bits": bits, "group_size": 64, "group_dim": 1, "symmetric": False}}
    t_build = time.perf_counter()
    hf_ds = HfDeepSpeedConfig(ds_config)  # noqa: F841 (kept alive: from_config builds under deepspeed.zero.Init)
    # Initialised, partitioned (quantized: Hugging Face's init then writes Gaussian values over the packed bytes
    # it gathers, so with q4/q8 the weights are dummy values, as everyone's here).
    model = AutoModelForCausalLM.from_config(build_hf_config(cfg), dtype=dtype)
    model.eval()
    experts = _same_experts_throughout(model, args)
    leaf_classes = []
    if moe_blocks(model):
        from deepspeed.utils import set_z3_leaf_modules

        leaf_classes = mark_moe_leaf_modules(model, set_z3_leaf_modules)
    engine = deepspeed.initialize(model=model, config=ds_config)[0]
    engine.module.eval()
    model = engine.module
    build_s = time.perf_counter() - t_build
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 1
    ids = _prompts(args, batch, cfg.vocab_size).to(device)
    with torch.no_grad():
        model.generate(input_ids=ids[:, :8], max_new_tokens=2, do_sample=False)  # warm-up
        _sync(device)
        _reset_peak(device)
        t0 = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=1, do_sample=False)
        _sync(device)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, max_new_tokens=args.gen_len, do_sample=False)
        _sync(device)
        total = time.perf_counter() - t0
    assert out.shape == (batch, args.prompt_len + args.gen_len)
    result = {"batch_size": batch, "experts_implementation": experts,
              "prefill_s": prefill, "decode_s": max(total - prefill, 0.0),
              "generated_tokens_per_s": batch * args.gen_len / total,
              "prefill_tokens_per_s": batch * args.prompt_len / prefill,
              "decode_tokens_per_s": batch * (args.gen_len - 1) / max(total - prefill, 1e-9),
              "peak_hbm_gib": _peak_hbm_gib(device), "host_peak_rss_gib": harness.host_peak_rss_gib(),
              "dtype": str(dtype).removeprefix("torch."), "weight_quantization": ds_config.get("weight_quantization"),
              "deepspeed": {"version": deepspeed.__version__, "zero_optimization": ds_config["zero_optimization"],
                            "z3_leaf_modules": leaf_classes, "build_and_initialize_s": build_s},
              "note": "full generate timed; prefill timed separately as a 1-token generate"}
    del engine, model
    try:  # a clean exit: the harness waits for the process
        torch.distributed.destroy_process_group()
    except Exception:
        pass
    return result


CONTENDERS = {"speedloader": run_speedloader, "accelerate": run_accelerate, "flexgen": run_flexgen,
              "zero-inference": run_zero_inference}


# --- driver --------------------------------------------------------------------------------------


def _ok(r: dict) -> bool:
    return r.get("status", "ok") == "ok" and "error" not in r  # (rows of older records have no status)


def _row(r: dict) -> str:
    if not _ok(r):
        return f"| {r['contender']} | | {r.get('status', 'error')}: {(r.get('error') or r.get('reason', ''))[:100]} | | | | |"
    io = r.get("io")
    io_s = (f"W {io['weights_h2d_bytes'] / 2**30:.0f} / KV {io['kv_h2d_bytes'] / 2**30:.0f}+"
            f"{io['kv_d2h_bytes'] / 2**30:.1f} / A {io['activation_bytes'] / 2**30:.1f} / "
            f"KV read on CPU {io.get('kv_cpu_attention_read_bytes', 0) / 2**30:.0f}") if io else ""
    return (f"| {r['contender']} | {r['batch_size']} | {r['generated_tokens_per_s']:.1f} | "
            f"{r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.1f} | {r['peak_hbm_gib']:.1f} | {io_s} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="opt_30b", help=f"a shape of conf/model/ ({', '.join(MODELS)})")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--gpu-memory-gib", type=float, default=24.0, help="the GPU budget of every contender")
    parser.add_argument("--host-memory-gib", type=float, default=110.0, help="accelerate's host max_memory")
    parser.add_argument("--contender", action="append", default=[], help="see the module docstring (repeatable)")
    parser.add_argument("--offload", choices=("auto", "yes", "no"), default="auto", help="speedloader weights")
    parser.add_argument("--prefetch", type=int, default=1, help="speedloader forward prefetch depth")
    parser.add_argument("--layers", type=int, default=None, help="the model with this many layers (default: all)")
    parser.add_argument("--profile", action="store_true",
                        help="speedloader: trace one more generation of up to 4 tokens and summarize where the "
                             "host-to-device copies ran relative to the CPU's attention (summarize_decode_trace)")
    parser.add_argument("--accelerate-margin-gib", type=float, default=4.0,
                        help="GPU memory kept free of accelerate's weights for activations and transfers")
    parser.add_argument("--flexgen-wheel", default=str(REPO / ".whl" / "flexgen-0.1.8-py3-none-any.whl"))
    parser.add_argument("--flexgen-percent", default=None, help='six numbers, e.g. "20 80 0 100 0 100"')
    parser.add_argument("--flexgen-cpu-cache-compute", choices=("yes", "no"), default=None)
    parser.add_argument("--experts-implementation", default="grouped_mm", choices=harness.EXPERTS_IMPLEMENTATIONS,
                        help="mixture of experts: the Hugging Face experts kernel of every contender, prefill and "
                             "decoding")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a check of the speedloader, accelerate and zero-inference code paths (tests); "
                             "no figure means anything")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per contender")
    parser.add_argument("--name", default=None)
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    parser.add_argument("--append", action="store_true",
                        help="merge into an existing record of the same --name (one contender per command)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        cfg = _model_config(args)  # an unknown name fails here, before any launch
    except ValueError as e:
        parser.error(str(e))

    if args.worker:
        name, _, spec = args.worker.partition(":")
        harness.print_result(CONTENDERS[name](args, spec))
        return

    contenders = args.contender or ["speedloader:64x4", "flexgen", "accelerate:8"]
    unknown = sorted({c.partition(":")[0] for c in contenders} - set(CONTENDERS))
    if unknown:
        parser.error(f"unknown contender(s) {unknown}; choose from {sorted(CONTENDERS)}")
    # Every contender with expandable segments (as the generate CLI sets it through train.launch), unless
    # the caller chose: under a cap, fragmentation otherwise decides which batches fit.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    header = harness.record_header("infer", __file__, device=harness.cpu_name() if args.device == "cpu" else None)
    depth = f"_L{args.layers}" if args.layers else ""
    name = args.name or f"infer_{cfg.name}{depth}_p{args.prompt_len}_g{args.gen_len}_{args.gpu_memory_gib:g}g"
    path = Path(args.out_dir, f"{name}.json")
    earlier, commands = [], [header["command"]]
    if args.append and path.is_file():  # earlier contenders of the same comparison (same model, lengths, budget)
        old = json.loads(path.read_text())
        earlier = old["results"]
        commands = old.get("commands", [old.get("command", "")]) + commands
    summary = harness.model_summary(cfg, args.prompt_len)  # meta device: parameters, active parameters
    record = {**header, "commands": commands, "config": {k: v for k, v in vars(args).items() if k != "worker"},
              "model": {k: v for k, v in summary.items() if k not in ("flops_per_token", "mfu_basis")},
              "results": []}
    rows = []
    for contender in contenders:
        reason = unsupported_reason(contender.partition(":")[0], cfg)
        if reason:  # not launched
            row = harness.unsupported_row(contender, reason, commit=header["commit"], device=header["device"])
        else:
            cmd = harness.worker_command(__file__, contender, sys.argv[1:], drop=("--contender",))
            # Rows merged with --append may come from other commits and machines: each names its own.
            row = harness.launch_worker(cmd, timeout=args.timeout).row(contender=contender, commit=header["commit"],
                                                                       device=header["device"])
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "output_tail"}), flush=True)
        mine = {r["contender"] for r in rows}
        record["results"] = [r for r in earlier if r["contender"] not in mine] + rows
        ok = {}  # the best setting of each contender, of this invocation only (rows --append merged came from
        for r in rows:  # other processes, commits or machines: never divided into a ratio, docs/benchmarking.md)
            if _ok(r):
                short = r["contender"].partition(":")[0]
                ok[short] = max(ok.get(short, 0.0), r["generated_tokens_per_s"])
        if "speedloader" in ok:
            record["speedup"] = {f"vs_{k}": ok["speedloader"] / v for k, v in ok.items() if k != "speedloader" and v > 0}
        harness.write_record(path, record)  # after every contender: a run cut short keeps what finished
    rows = record["results"]
    print(f"\n{cfg.name}, prompt {args.prompt_len}, generate {args.gen_len}, GPU budget {args.gpu_memory_gib:g} GiB "
          f"({record['device']})\n")
    print("| contender | batch | generated tok/s | prefill tok/s | decode tok/s | peak HBM GiB | I/O GiB (weights / KV h2d+d2h / act / KV read on CPU) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(_row(r))
    if record.get("speedup"):
        print("\nspeedup of speedloader: " + ", ".join(f"{k} {v:.2f}x" for k, v in record["speedup"].items()))


if __name__ == "__main__":
    main()
