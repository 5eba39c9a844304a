"""The ``deepspeed-offload`` contender of tools/bench_train.py: DeepSpeed ZeRO-3, parameters and
optimizer offloaded to the host, DeepSpeedCPUAdam, bf16, every block checkpointed.

A benchmark peer only, never a dependency of the package. DeepSpeed is a source archive on PyPI:
tools/build_deepspeed_wheels.sh builds its wheel (ops left to JIT) plus the missing pure-Python
dependencies into .whl/, and prints the install line for the GPU machine. Its CPU Adam is compiled
there with g++/ninja on first use (about 1-2 minutes) into $TORCH_EXTENSIONS_DIR, which defaults to
/tmp/fsl_torch_extensions so that later contenders of the same command reuse the build.

bench_train's worker calls :func:`run_deepspeed` for ``--contender deepspeed-offload:nxN``
(micro-batch n, N gradient-accumulation steps) and records the same figures as every contender.
``FSL_DS_ZERO_OVERRIDES`` (JSON) is merged into the ``zero_optimization`` section, to try other
bucket sizes without editing this file; the settings used are recorded in the result.

A mixture of experts (Mixtral, Qwen3-MoE): each block's sparse MLP (router + experts, :func:`moe_blocks`) is
made a ZeRO-3 leaf module (``deepspeed.utils.set_z3_leaf_modules``, before ``deepspeed.initialize``), so
ZeRO-3 gathers a layer's router and all its experts at the block's pre-forward and releases them after it,
instead of tracing and prefetching module by module through routing that changes every step (which can
mis-prefetch or hang across ranks). DeepSpeed 0.19.8 also lists these two Hugging Face classes in its
default ``zero_optimization.leaf_module.classes``; setting them here makes the choice explicit, version
independent, and checked (the result records the classes and that every block was flagged). The experts run
``--experts-implementation`` (bench_train's, the same kernel as every other contender).
"""

from __future__ import annotations

import argparse
import json
import os
import time

GIB = 2**30


def activation_bytes(sub_batch: int, seq_len: int, layers: int, hidden: int, inter: int, vocab: int, *,
                     experts_per_token: int = 0, loss_chunk_tokens: int = 0) -> int:
    """A (deliberately high) estimate of one micro-batch's peak activation memory under full recompute.

    Per token: the bf16 input of every block kept for recompute (2 L h bytes); one block's forward
    activations being recomputed and their gradients (about 3 (10 h + 4 i) bytes: q, k, v, rotated
    q/k, attention output, norms and residuals, gate/up/act/product); the logits in bf16, their fp32
    copy in the loss, the fp32 log-softmax saved for backward and the logit gradient (12 V bytes); with the head's
    loss chunked (``loss_chunk_tokens`` > 0), those of one chunk only.
    A mixture of experts (``experts_per_token`` = k > 0, ``inter`` = one expert's width): every token's k
    routed copies go through the experts, 4 k i for their gate/up/act/product and 3 k h for the token copies
    gathered in, the expert outputs and their weighted sum.
    """
    mlp = 4 * experts_per_token * inter + 3 * experts_per_token * hidden if experts_per_token else 4 * inter
    tokens = sub_batch * seq_len
    logit_tokens = min(tokens, loss_chunk_tokens) if loss_chunk_tokens > 0 else tokens
    return tokens * (2 * layers * hidden + 3 * (10 * hidden + mlp)) + logit_tokens * 12 * vocab


def moe_blocks(model) -> list:
    """A mixture of experts' sparse MLP blocks: the modules holding a router (``gate``) and their ``experts``
    (Hugging Face's MixtralSparseMoeBlock, Qwen3MoeSparseMoeBlock); [] for a dense model."""
    import torch

    return [m for m in model.modules() if isinstance(getattr(m, "gate", None), torch.nn.Module)
            and isinstance(getattr(m, "experts", None), torch.nn.Module)]


def mark_moe_leaf_modules(model, set_z3_leaf_modules) -> list[str]:
    """Makes every sparse MLP block of ``model`` a ZeRO-3 leaf module through ``set_z3_leaf_modules``
    (``deepspeed.utils``'s, passed in: this module imports without DeepSpeed); returns the classes' qualified
    names, [] for a dense model (nothing set)."""
    classes = list(dict.fromkeys(type(m) for m in moe_blocks(model)))
    if classes:
        set_z3_leaf_modules(model, classes)
    return [f"{c.__module__}.{c.__qualname__}" for c in classes]


def zero_settings(cap_bytes: int, act_bytes: int, block_numel: int, model_numel: int) -> dict:
    """ZeRO-3 bucket and residency settings that keep the GPU under ``cap_bytes``.

    What ZeRO-3 with offload holds on the GPU besides activations:
      * gathered bf16 parameters: at most ``stage3_max_live_parameters`` elements from prefetching
        (prefetch stops at that many live elements), more only through reuse: a parameter is not
        released if it is used again within ``stage3_max_reuse_distance`` elements of the trace, so
        reuse distance is set equal to the live limit; 2 bytes each;
      * the gradient bucket: ``reduce_bucket_size`` bf16 elements, plus fp32 temporaries while the
        partitions are accumulated (the accumulated fp32 partition is copied up, added to and copied
        back on every micro-batch after the first): about 8 bytes per bucket element;
      * persistent parameters (smaller than ``stage3_param_persistence_threshold``: only the RMSNorm
        scales, h elements each, a few hundred KiB for the whole model) that never leave the GPU.
    Budget: W = cap - activation estimate - reserve (10 % of the cap + 1 GiB for allocator
    fragmentation and the CUDA workspace). A quarter of W goes to the gradient bucket (between 1/8
    block and 1 block of elements: a block per bucket already makes the copies large), three quarters
    to live parameters, clamped to [2 blocks, the whole model]: beyond the whole model more buys
    nothing; near the whole model the forward's parameters can stay gathered for the backward (up to
    half the host-to-device bytes), this peer's best use of the memory budget it is allowed. Prefetch
    is one to two blocks ahead (one block of bf16 weights crosses PCIe in about the time a block's
    forward takes at micro-batch 1-2 with sequence 4096, so deeper prefetch only holds memory). When W
    is too small even for the minimum (2 blocks live, 1/8 block bucket) the minimum is used and the
    run may hit the cap (recorded as an out-of-memory error).
    """
    reserve = int(0.10 * cap_bytes) + GIB
    budget = max(0, cap_bytes - act_bytes - reserve)
    reduce_bucket = int(min(block_numel, max(block_numel // 8, budget * 0.25 / 8)))
    live = int(min(model_numel, max(2 * block_numel, budget * 0.75 / 2)))
    prefetch = int(min(2 * block_numel, max(block_numel // 4, live // 2)))
    return {
        "reduce_bucket_size": reduce_bucket,
        "stage3_prefetch_bucket_size": prefetch,
        "stage3_max_live_parameters": live,
        "stage3_max_reuse_distance": live,
        "stage3_param_persistence_threshold": int(1e5),  # DeepSpeed's default: norm scales only
        "budget_gib": budget / GIB, "activation_estimate_gib": act_bytes / GIB,
    }


def deepspeed_config(sub_batch: int, num_sub: int, world_size: int, zero: dict) -> dict:
    """The DeepSpeed config: ZeRO-3, parameters and optimizer state on pinned host memory, bf16,
    DeepSpeedCPUAdam (what DeepSpeed builds for AdamW when the optimizer is offloaded) with the
    hyperparameters of the other contenders' ``torch.optim.AdamW(lr=1e-5)``, no gradient clipping."""
    zero_opt = {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": True},
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        **{k: v for k, v in zero.items() if not k.endswith("_gib")},
    }
    overrides = os.environ.get("FSL_DS_ZERO_OVERRIDES")
    if overrides:
        zero_opt.update(json.loads(overrides))
    return {
        "train_batch_size": sub_batch * num_sub * world_size,
        "train_micro_batch_size_per_gpu": sub_batch,
        "gradient_accumulation_steps": num_sub,
        "bf16": {"enabled": True},
        "gradient_clipping": 0.0,
        "zero_optimization": zero_opt,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def host_bytes(model_numel: int, pow2_pinned: bool, sub_group_size: int = 10**9) -> int:
    """Host memory of DeepSpeed 0.19.8 ZeRO-3 with parameters and optimizer offloaded, steady state.

    Read from stage3.py: a pinned flat bf16 copy of the parameters (2 B/param), the fp32 master
    partitions (4), a pinned fp32 gradient per optimizer sub-group (4), the pinned fp32
    gradient-accumulation buffer (4), Adam's two fp32 moments (8, made at the first step): 22 B/param
    (a CPU run of this file measured 26.7 B/param, its activations and gathered weights included).
    PyTorch's pinned allocator rounds each pinned tensor up to a power of two unless told otherwise.
    """
    def pin(nbytes: int) -> int:
        return 1 << (int(nbytes) - 1).bit_length() if pow2_pinned and nbytes > 0 else int(nbytes)

    groups, left = [], model_numel  # sub-groups close once they reach sub_group_size (overshoot ignored)
    while left > 0:
        groups.append(min(left, sub_group_size))
        left -= groups[-1]
    pinned = pin(2 * model_numel) + sum(pin(4 * g) for g in groups) + pin(4 * model_numel)
    return pinned + 12 * model_numel


def _seeded_init(model, deepspeed, seed: int, std: float) -> None:
    """The weights of every other contender (fsdp_speedloader.models.init.init_weights: N(0, std) per
    matrix from generators seeded by (seed, name, stretch), ones for norm scales, zeros for biases), written
    after ``deepspeed.initialize`` into both copies, one gathered module at a time: the bf16 partitions
    the forward uses and the fp32 master weights. DeepSpeed makes its masters from the bf16 partitions;
    masters sitting exactly on the bf16 grid would not move the bf16 weights until updates add up to
    half a bf16 step (about 6 steps at lr 1e-5), and the first losses would differ from the FSDP2
    contenders', whose fp32 parameters are cast to bf16 for compute."""
    import torch
    from deepspeed.utils import safe_set_full_fp32_param

    from fsdp_speedloader.models.init import initial_value

    named = dict(model.named_parameters())
    names = {id(p): n for n, p in named.items()}
    with torch.no_grad():
        for module in model.modules():
            params = list(module.parameters(recurse=False))
            if not params:
                continue
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                for param in params:
                    full = initial_value(module, names[id(param)], tuple(param.ds_shape), seed=seed, std=std)
                    param.data.copy_(full.view(param.data.shape))
                    safe_set_full_fp32_param(param, full)


def _pinned_rounding_off(threshold_mb: int = 16) -> str:
    """PyTorch's pinned-memory allocator rounds every request up to a power of two (a 7 GiB gradient
    buffer takes 8): ZeRO-3 offload pins 10 of its 22 bytes per parameter. Newer PyTorch can skip the
    rounding above a threshold; report whether this one could."""
    import torch

    setting = f"pinned_max_round_threshold_mb:{threshold_mb}"
    try:
        current = torch._C._accelerator_getAllocatorSettings()
        torch._C._accelerator_setAllocatorSettings(f"{current},{setting}" if current else setting)
        return setting
    except Exception as exc:  # older torch: no such key or no such function
        return f"power-of-two rounding kept ({type(exc).__name__}: {str(exc)[:80]})"


def run_deepspeed(args, sub_batch: int, num_sub: int, loss_chunk_tokens: int = 0) -> dict:
    """One deepspeed-offload contender in this process: build, warm up, time, return bench_train's figures.
    ``loss_chunk_tokens`` > 0: the head's logits for that many tokens at a time (``models.chunked_loss``)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/fsl_torch_extensions")  # CPU Adam JIT build, reused
    try:
        import deepspeed
    except ImportError as exc:
        raise SystemExit(f"deepspeed-offload: deepspeed not installed ({exc}); build the wheels with "
                         "tools/build_deepspeed_wheels.sh and install them") from None
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import bench_train as bt
    import harness
    import protocol
    from launch_two_nodes import free_port

    from fsdp_speedloader.models import build_hf_config, build_model, get_adapter
    from fsdp_speedloader.models.chunked_loss import causal_lm_loss

    cuda = torch.cuda.is_available() and getattr(args, "device", "cuda") == "cuda"
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(device).total_memory
        if args.max_gpu_memory_gib:
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.max_gpu_memory_gib * GIB / total), device)
        pinned = _pinned_rounding_off()
    else:  # CPU check of the code path only (DeepSpeed's CPU accelerator); no figure means anything
        device, total, pinned = torch.device("cpu"), 0, "n/a (cpu)"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    world = torch.distributed.get_world_size()

    cfg = bt.model_config(args)
    hidden, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    routed = cfg.num_experts_per_tok or 0  # a mixture of experts: each token's expert copies
    if routed and cfg.moe_intermediate_size:  # Qwen3-MoE: the experts' width (Mixtral's is intermediate_size)
        inter = cfg.moe_intermediate_size
    meta = build_model(cfg)  # meta: the figures (FLOPs, sizes) every contender uses; before ZeRO-3 is enabled
    adapter = get_adapter(meta)
    flops_per_token = adapter.flops_per_token(args.seq_len)
    attention_flops_per_token = adapter.attention_flops_per_token(args.seq_len)
    block_numel = sum(p.numel() for p in adapter.blocks[0].parameters())
    model_numel = sum(p.numel() for p in meta.parameters())
    del meta, adapter

    # Refuse rather than let the kernel kill the machine's biggest process mid-run: the full 7B needs
    # about 138 GiB here, more than a 128 GiB host (raise the limit to try anyway).
    host_need = host_bytes(model_numel, pow2_pinned=cuda and not pinned.startswith("pinned_max_round"))
    host_limit = float(os.environ.get("FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB", "120")) * GIB
    if host_need > host_limit:
        raise SystemExit(f"deepspeed-offload: ZeRO-3 offload needs about {host_need / GIB:.0f} GiB of host memory "
                         f"for {model_numel / 1e9:.2f}B parameters (22 B/param plus pinned rounding), above "
                         f"{host_limit / GIB:.0f} GiB (FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB)")
    cap = int(args.max_gpu_memory_gib * GIB) if args.max_gpu_memory_gib else (total or 80 * GIB)
    act = activation_bytes(sub_batch, args.seq_len, cfg.num_layers, hidden, inter, vocab, experts_per_token=routed,
                           loss_chunk_tokens=loss_chunk_tokens)
    zero = zero_settings(cap, act, block_numel, model_numel)
    ds_config = deepspeed_config(sub_batch, num_sub, world, zero)

    # Hugging Face's own ZeRO-3 path: with an HfDeepSpeedConfig alive, from_config builds the model
    # under deepspeed.zero.Init (each parameter made on the GPU, then partitioned to pinned host memory
    # as bf16: the full model never exists on one device) and initialises it module by module.
    t_build = time.perf_counter()
    hf_ds = HfDeepSpeedConfig(ds_config)  # noqa: F841 (transformers keeps only a weak reference)
    hf = build_hf_config(cfg)
    model = AutoModelForCausalLM.from_config(hf, attn_implementation=cfg.attn_implementation, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    experts = harness.set_experts_implementation(model, getattr(args, "experts_implementation", None))
    blocks = moe_blocks(model)
    leaf_classes: list = []
    if blocks:  # before initialize: ZeRO-3 places its hooks there, stopping at leaf modules
        try:
            from deepspeed.utils import set_z3_leaf_modules
        except ImportError:
            raise SystemExit(f"deepspeed-offload: DeepSpeed {deepspeed.__version__} has no set_z3_leaf_modules "
                             "(0.13 or later has): ZeRO-3 cannot gather a mixture of experts' block at once") from None
        leaf_classes = mark_moe_leaf_modules(model, set_z3_leaf_modules)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    unflagged = [type(b).__name__ for b in blocks if not getattr(b, "_z3_leaf", False)]
    if unflagged:
        raise RuntimeError(f"deepspeed-offload: {len(unflagged)} of {len(blocks)} MoE blocks are not ZeRO-3 leaf "
                           f"modules after deepspeed.initialize ({unflagged[0]})")
    _seeded_init(model, deepspeed, seed=0, std=cfg.init_std)
    for buf in model.buffers():  # never partitioned; made on the GPU under zero.Init, but make sure (RoPE)
        if buf.device != device:
            buf.data = buf.data.to(device)
    build_s = time.perf_counter() - t_build
    basic = getattr(optimizer, "optimizer", optimizer)
    if type(basic).__name__ != "DeepSpeedCPUAdam":
        raise RuntimeError(f"deepspeed-offload: expected DeepSpeedCPUAdam, DeepSpeed built {type(basic).__name__}")
    engine.train()

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (sub_batch * num_sub, args.seq_len), generator=gen)

    def fwd_bwd():
        """All micro-batches; DeepSpeed scales each loss by 1/N and counts micro-steps in step(),
        whose optimizer update only runs at the boundary (returned to the caller, timed apart)."""
        loss_sum = 0.0
        for k, mb in enumerate(ids.split(sub_batch)):
            mb = mb.to(device, non_blocking=True)
            loss = causal_lm_loss(engine.module, mb, mb, chunk_tokens=loss_chunk_tokens, forward=engine)
            engine.backward(loss)
            loss_sum += loss.detach()
            if k < num_sub - 1:
                engine.step()  # not a boundary: bookkeeping only
        assert engine.is_gradient_accumulation_boundary()
        return loss_sum / num_sub  # equal token counts: the mean over the whole batch, as the others report

    fb_times, opt_times, losses, profile, host = bt.time_steps(
        fwd_bwd, engine.step,  # the boundary step: DeepSpeedCPUAdam on the host, updated bf16 partitions
        argparse.Namespace(**{**vars(args), "profile": args.profile and cuda}), sync=sync,
        reset_peak=torch.cuda.reset_peak_memory_stats if cuda else (lambda: None))
    result = {
        "contender": "deepspeed-offload", "sub_batch_size": sub_batch, "num_sub_batches": num_sub,
        "experts_implementation": experts,
        **protocol.step_figures(fb_times, opt_times, losses, tokens=ids.numel(), flops_per_token=flops_per_token,
                                peak_tflops=args.peak_tflops, attention_flops_per_token=attention_flops_per_token,
                                recomputed=1.0, host_peak_rss_gib=harness.host_peak_rss_gib()),
        **host,
        "peak_hbm_gib": torch.cuda.max_memory_allocated() / GIB if cuda else 0.0,
        "peak_hbm_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else 0.0,
        "deepspeed": {"version": deepspeed.__version__, "zero_optimization": ds_config["zero_optimization"],
                      "budget_gib": zero["budget_gib"], "activation_estimate_gib": zero["activation_estimate_gib"],
                      "gpu_cap_gib": cap / GIB, "host_estimate_gib": host_need / GIB, "pinned_allocator": pinned,
                      "build_and_initialize_s": build_s, "optimizer": type(basic).__name__,
                      "z3_leaf_modules": leaf_classes, "num_z3_leaf_modules": len(blocks)},
    }
    if profile is not None:
        result["profile"] = profile
    del engine, optimizer, model
    try:  # a clean exit: the harness waits for the process, not only for its RESULT line
        torch.distributed.destroy_process_group()
    except Exception:
        pass
    return result
