"""Layer-major generation on CPU: token-for-token parity with Hugging Face ``generate``, EOS, sampling, errors.

The reference is the unmodified model (``copy.deepcopy`` of the same initialised weights), fp32, and
its own ``generate``: greedy with the cache for kv_cache 'device'/'host', ``use_cache=False`` for
'off' (both recompute the whole prefix every step, so the arithmetic is the same). Prompts are
left-padded to different lengths. World size 2 (gloo): each rank generates on its own prompts.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from engine_cases import count_collectives, cpu_mesh
from fsdp_speedloader import apply_speedloader, speedloader_engine
from fsdp_speedloader.app.config import ModelConfig
from fsdp_speedloader.generation.generate import GenerationStats, generate
from fsdp_speedloader.models import build_model

VOCAB, PROMPT_LEN, NEW = 96, 7, 10
_MODELS: dict = {}


def _tiny(family: str) -> torch.nn.Module:
    """A 3-layer model (GQA for LLaMA), built once per family; tests deep-copy it."""
    if family not in _MODELS:
        cfg = ModelConfig(family=family, hidden_size=64, num_layers=3, num_heads=4,
                          num_kv_heads=2 if family == "llama" else None, intermediate_size=128, vocab_size=VOCAB,
                          max_position_embeddings=32)
        _MODELS[family] = build_model(cfg, device="cpu", seed=1)
    return _MODELS[family]


def _prompts(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of lengths 1..PROMPT_LEN (row 0 full length, the last row one token), pad id 0."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=gen)
    lengths = torch.randint(1, PROMPT_LEN + 1, (batch,), generator=gen)
    lengths[0], lengths[-1] = PROMPT_LEN, 1
    mask = (torch.arange(PROMPT_LEN)[None] >= (PROMPT_LEN - lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def _reference(model, ids, mask, *, eos=None, pad=0, use_cache=True, max_new_tokens=NEW) -> torch.Tensor:
    ref = copy.deepcopy(model)
    ref.generation_config.eos_token_id = eos
    ref.generation_config.pad_token_id = pad
    return ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                        use_cache=use_cache)


def _prepared(family: str, num_sub_batches: int, **kwargs) -> torch.nn.Module:
    return apply_speedloader(copy.deepcopy(_tiny(family)), mesh=cpu_mesh(), num_sub_batches=num_sub_batches,
                             **kwargs)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_greedy_parity_with_hugging_face(family):
    """Every (kv_cache, N) case on one prepared model per N: fp32 greedy tokens equal HF's exactly."""
    ids, mask = _prompts(4)
    cached, recomputed = _reference(_tiny(family), ids, mask), _reference(_tiny(family), ids, mask, use_cache=False)
    assert (mask == 0).any() and cached.shape == (4, PROMPT_LEN + NEW)
    for n_sub in (1, 2, 4):
        model = _prepared(family, n_sub)
        for kv_cache in ("device", "host", "off") + (("split",) if n_sub > 1 else ()):
            got = generate(model, ids, mask, max_new_tokens=NEW, num_sub_batches=n_sub, kv_cache=kv_cache)
            want = recomputed if kv_cache == "off" else cached
            assert got.dtype == torch.long and torch.equal(got, want), (family, n_sub, kv_cache, got, want)


@pytest.mark.parametrize("family,offload,blocks_per_unit", [("llama", True, 2), ("opt", True, 1), ("opt", False, 3)])
def test_parity_with_offload_and_larger_units(family, offload, blocks_per_unit):
    ids, mask = _prompts(4, seed=1)
    model = _prepared(family, 2, offload_params=offload, blocks_per_unit=blocks_per_unit, activation_store="host")
    want = _reference(_tiny(family), ids, mask)
    for kv_cache in ("host", "device", "split"):  # device: whole-batch decoding steps through the host activation slots
        got = generate(model, ids, mask, max_new_tokens=NEW, num_sub_batches=2, kv_cache=kv_cache)
        assert torch.equal(got, want), kv_cache


def test_on_step_is_called_once_per_step_and_nothing_is_printed(capfd):
    """The library prints nothing; a caller's progress display counts the steps through ``on_step``."""
    ids, mask = _prompts(2, seed=2)
    model = _prepared("llama", 2)
    capfd.readouterr()
    steps = []
    got = generate(model, ids, mask, max_new_tokens=NEW, num_sub_batches=2, on_step=steps.append)
    assert steps == list(range(1, NEW + 1))
    assert torch.equal(got, generate(model, ids, mask, max_new_tokens=NEW, num_sub_batches=2))
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_no_mask_and_unpadded_prompts():
    ids, _ = _prompts(2, seed=2)
    model = _prepared("llama", 2)
    want = _reference(_tiny("llama"), ids, torch.ones_like(ids))
    assert torch.equal(generate(model, ids, max_new_tokens=NEW, num_sub_batches=2), want)
    assert torch.equal(generate(model, ids, torch.ones_like(ids), max_new_tokens=NEW, num_sub_batches=2), want)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_eos_pads_finished_sequences_as_hugging_face(family):
    ids, mask = _prompts(4, seed=3)
    free = _reference(_tiny(family), ids, mask)[:, PROMPT_LEN:]
    eos = int(free[1, 3])  # row 1 ends by its 4th new token; others may end too, or run to the end
    want = _reference(_tiny(family), ids, mask, eos=eos, pad=1)
    model = _prepared(family, 2)
    got = generate(model, ids, mask, max_new_tokens=NEW, num_sub_batches=2, eos_token_id=eos, pad_token_id=1,
                   kv_cache="host")
    assert torch.equal(got, want)
    first = int((free[1] == eos).nonzero()[0])  # at the latest its 4th new token
    assert got[1, PROMPT_LEN + first] == eos and (got[1, PROMPT_LEN + first + 1 :] == 1).all()


def test_stops_early_when_every_sequence_ended():
    ids, mask = _prompts(1, seed=4)
    ids, mask = ids.repeat(2, 1), mask.repeat(2, 1)  # both rows generate the same tokens
    free = _reference(_tiny("opt"), ids, mask)[:, PROMPT_LEN:]
    eos = int(free[0, 2])
    first = int((free[0] == eos).nonzero()[0])  # the first time it appears (maybe before position 2)
    model = _prepared("opt", 2)
    steps = []
    got = generate(model, ids, mask, max_new_tokens=NEW, num_sub_batches=2, eos_token_id=[eos, VOCAB - 1],
                   on_step=steps.append)
    assert got.shape == (2, PROMPT_LEN + first + 1)
    assert steps == list(range(1, first + 2))  # one call per step run, the prefill first
    assert torch.equal(got, _reference(_tiny("opt"), ids, mask, eos=[eos, VOCAB - 1], pad=eos))


def test_sampling_is_reproducible_with_a_seed_and_independent_of_num_sub_batches():
    ids, mask = _prompts(4, seed=5)
    runs = {}
    for n_sub in (2, 4):
        model = _prepared("llama", n_sub)
        for seed in (7, 8):
            runs[n_sub, seed] = generate(model, ids, mask, max_new_tokens=NEW, num_sub_batches=n_sub, do_sample=True,
                                         temperature=0.7, top_k=20, top_p=0.9, seed=seed)
    assert torch.equal(runs[2, 7], runs[4, 7])
    assert not torch.equal(runs[2, 7], runs[2, 8])
    greedy = generate(model, ids, mask, max_new_tokens=NEW, num_sub_batches=4)
    assert not torch.equal(runs[4, 7], greedy)  # it does sample
    # top_k=1 is greedy whatever the temperature.
    assert torch.equal(generate(model, ids, mask, max_new_tokens=NEW, num_sub_batches=4, do_sample=True,
                                temperature=3.0, top_k=1, seed=0), greedy)


@pytest.mark.parametrize("offload", [True, False])
def test_one_unshard_per_unit_per_step_and_stats(offload):
    """Offloaded weights: each unit is unsharded once per step, whatever N. Weights whole on the one rank
    (resident, no cast): the modules run on the local shards, with no unshard at all, and FSDP2's sharded
    parameters are back afterwards (training works, the tokens are HF's)."""
    from torch.distributed.tensor import DTensor

    ids, mask = _prompts(4, seed=6)
    model = _prepared("llama", 4, blocks_per_unit=1, offload_params=offload)
    generate(model, ids, mask, max_new_tokens=2, num_sub_batches=4)  # lazy init; the root stays unsharded
    for kv_cache in ("host", "off"):
        counts, undo = count_collectives()
        try:
            out, stats = generate(model, ids, mask, max_new_tokens=5, num_sub_batches=4, kv_cache=kv_cache,
                                  return_stats=True)
        finally:
            undo()
        assert counts["unshard"] == (3 * 5 if offload else 0), counts  # 3 units x 5 steps, whatever N
        assert isinstance(stats, GenerationStats) and stats.num_steps == 5 and stats.kv_cache == kv_cache
        assert stats.prefill_tokens_per_s > 0 and stats.decode_tokens_per_s > 0
    assert torch.equal(out, _reference(_tiny("llama"), ids, mask, max_new_tokens=5))
    assert out.shape == (4, PROMPT_LEN + 5)
    assert model.training  # restored
    assert all(isinstance(p, DTensor) for p in model.model.layers.parameters())
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.model.layers.parameters())


def test_decoding_runs_each_layer_once_per_step_with_the_kv_cache_on_the_device(monkeypatch):
    """Device KV: the prefill runs every layer per sub-batch, a decoding step once on the whole batch (host
    overhead, not the weights, bounds decoding). Host KV keeps per-sub-batch calls (its copies overlap them)."""
    from fsdp_speedloader.models import ModelAdapter

    rows: list[int] = []
    run_block = ModelAdapter.run_block

    def counted(self, block, hidden, inputs, **kwargs):
        rows.append(hidden.shape[0])
        return run_block(self, block, hidden, inputs, **kwargs)

    monkeypatch.setattr(ModelAdapter, "run_block", counted)
    ids, mask = _prompts(4, seed=8)
    layers, new = 3, 5
    model = _prepared("llama", 4)
    for kv_cache, decode_calls in (("device", [4] * layers), ("host", [1] * (4 * layers))):
        rows.clear()
        got = generate(model, ids, mask, max_new_tokens=new, num_sub_batches=4, kv_cache=kv_cache)
        assert torch.equal(got, _reference(_tiny("llama"), ids, mask, max_new_tokens=new))
        assert rows[: 4 * layers] == [1] * (4 * layers), rows  # prefill: sub-batches of 1 sequence
        assert rows[4 * layers :] == decode_calls * (new - 1), (kv_cache, rows)


# Python-level calls that make the host wait for the GPU when the tensor lives there.
_SYNCING_CALLS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "masked_select",
                  "unique", "cpu", "numpy"}


@pytest.mark.parametrize("kv_cache", ["device", "host"])
def test_no_syncing_tensor_call_in_steady_state_decoding(kv_cache, monkeypatch):
    """From the second decoding step on, no ``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``nonzero``, ...
    runs on a tensor, except in ``_causal_mask``, whose tensors are on the host by design (Hugging Face's mask
    code reads the padding mask's values). On the GPU each would stall the pipeline once per step; the CPU
    sees the Python-level calls (a torch function mode), ``test_generate_gpu.py`` also the ones inside kernels
    (CUDA's sync debug mode)."""
    import traceback

    from torch.overrides import TorchFunctionMode

    from fsdp_speedloader.generation import kv_cache as kv_module

    calls: list[str] = []

    class SyncWatch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in _SYNCING_CALLS:
                stack = traceback.extract_stack()
                if not any(f.name == "_causal_mask" and f.filename.endswith("step.py") for f in stack):
                    calls.append(f"{name} at " + " <- ".join(f"{f.name}:{f.lineno}" for f in stack[-2:-7:-1]))
            return func(*args, **(kwargs or {}))

    watch = SyncWatch()
    cls = kv_module.DeviceKVCache if kv_cache == "device" else kv_module.HostKVCache
    begin_step, close = cls.begin_step, cls.close

    def watched_begin_step(self, past, query):
        begin_step(self, past, query)
        if past == PROMPT_LEN + 1:  # the second decoding step: on until the cache closes
            watch.__enter__()

    def unwatched_close(self):
        if torch._C._is_torch_function_mode_enabled():
            watch.__exit__(None, None, None)
        close(self)

    monkeypatch.setattr(cls, "begin_step", watched_begin_step)
    monkeypatch.setattr(cls, "close", unwatched_close)
    ids, mask = _prompts(4, seed=9)
    got = generate(_prepared("opt", 2), ids, mask, max_new_tokens=NEW, num_sub_batches=2, kv_cache=kv_cache)
    assert torch.equal(got, _reference(_tiny("opt"), ids, mask))
    assert not calls, calls[:5]


def test_split_kv_copies_only_the_host_sub_batches():
    """kv_cache='split' with D of N sub-batches on the device: greedy tokens equal HF's for every D, the host
    part (the first N - D sub-batches) is the only one copied, and the reported bytes are exactly its copies."""
    ids, mask = _prompts(4, seed=11)
    want = _reference(_tiny("opt"), ids, mask)
    model = _prepared("opt", 4)
    per_position = {}  # KV bytes of one position of one layer of one sub-batch (1 sequence here)
    for on_device in (1, 2, 3):
        out, stats = generate(model, ids, mask, max_new_tokens=NEW, num_sub_batches=4, kv_cache="split",
                              kv_device_sub_batches=on_device, return_stats=True)
        assert torch.equal(out, want), on_device
        assert stats.kv_cache == "split" and stats.io["kv_device_sub_batches"] == on_device
        layers, host = _tiny("opt").config.num_hidden_layers, 4 - on_device
        fetched = sum(PROMPT_LEN + step for step in range(1, NEW))  # positions fetched per decoding step
        per_position[on_device] = stats.io["kv_h2d_bytes"] / (host * layers * fetched)
        assert stats.io["kv_d2h_bytes"] == host * layers * (PROMPT_LEN + NEW - 1) * per_position[on_device]
    assert len(set(per_position.values())) == 1, per_position  # the bytes scale with the host sub-batches only


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_cpu_attention_sub_batches_attend_next_to_the_host_cache(family):
    """The first C host sub-batches attend on the host (their cache handed to attention where it is):
    greedy tokens equal HF's for host and split caches, those sub-batches are never fetched, the bytes
    their attention read are reported, and the model's attention implementation is restored."""
    ids, mask = _prompts(4, seed=13)
    want = _reference(_tiny(family), ids, mask)
    model = _prepared(family, 4)
    implementation = model.config._attn_implementation
    layers = _tiny(family).config.num_hidden_layers
    fetched = sum(PROMPT_LEN + step for step in range(1, NEW))  # positions read per sub-batch and layer
    per_position = None
    for kv_cache, on_device, on_cpu in (("host", None, 1), ("host", None, 4), ("split", 1, 3), ("split", 2, 1)):
        out, stats = generate(model, ids, mask, max_new_tokens=NEW, num_sub_batches=4, kv_cache=kv_cache,
                              kv_device_sub_batches=on_device, cpu_attention_sub_batches=on_cpu, return_stats=True)
        assert torch.equal(out, want), (kv_cache, on_device, on_cpu)
        assert model.config._attn_implementation == implementation
        copied = 4 - (on_device or 0) - on_cpu
        read = stats.io["kv_cpu_attention_read_bytes"]
        per_position = per_position or read / (on_cpu * layers * fetched)
        assert read == on_cpu * layers * fetched * per_position
        assert stats.io["kv_h2d_bytes"] == copied * layers * fetched * per_position
        assert stats.io["kv_cpu_attention_sub_batches"] == on_cpu
        assert stats.io["cpu_attention_calls"] == 0  # without CUDA the cache IS on the attention's device


@pytest.mark.parametrize("kv_cache", ["host", "split", "device", "off"])
def test_decoding_steps_keep_activations_on_the_device(kv_cache):
    """With a KV cache, a decoding step's one-token activations never go through the model's (host)
    activation store, so no input waits behind weights queued on the link; the prefill's do, and so does
    every step of kv_cache='off' (whole sequences). Tokens equal HF's either way."""
    ids, mask = _prompts(4, seed=17)
    want = _reference(_tiny("llama"), ids, mask)
    model = _prepared("llama", 2, activation_store="host")
    store, lengths = speedloader_engine(model).store, []
    put = store.put
    store.put = lambda slot, i, x: (lengths.append(x.shape[1]), put(slot, i, x))[1]
    out = generate(model, ids, mask, max_new_tokens=NEW, num_sub_batches=2, kv_cache=kv_cache,
                   kv_device_sub_batches=1 if kv_cache == "split" else None)
    assert torch.equal(out, want)
    steps = 1 if kv_cache != "off" else NEW  # steps that run whole sequences through the store
    units = len(speedloader_engine(model).units)
    want_lengths = [PROMPT_LEN + step for step in range(steps) for _ in range((units + 1) * 2)]
    assert lengths == want_lengths


def test_auto_kv_cache_splits_when_only_some_sub_batches_fit(monkeypatch):
    from fsdp_speedloader.generation import kv_cache as kv_module
    from fsdp_speedloader.generation.kv_cache import choose_kv_mode, kv_layout_for

    layout = kv_layout_for(_tiny("opt").config, num_sub_batches=4, sub_batch_size=2, capacity=16, dtype=torch.float32)
    cuda = torch.device("cuda", 0)
    for fit, want in ((4, ("device", 4)), (3, ("split", 3)), (1, ("split", 1)), (0, ("host", 0))):
        monkeypatch.setattr(kv_module, "device_sub_batches_that_fit", lambda *a, fit=fit, **k: fit)
        assert choose_kv_mode("auto", layout, cuda) == want
    assert choose_kv_mode("split", layout, cuda, device_sub_batches=2) == ("split", 2)
    with pytest.raises(ValueError, match="use kv_cache='host'"):
        choose_kv_mode("split", layout, cuda)  # fit is 0 from the last patch
    monkeypatch.undo()
    assert choose_kv_mode("auto", layout, torch.device("cpu")) == ("device", 4)  # without CUDA the host is the device


def test_model_generates_after_training_and_trains_after_generating():
    ids, mask = _prompts(4, seed=7)
    model = _prepared("opt", 2)
    model(input_ids=ids, labels=ids).loss.backward()
    generate(model, ids, mask, max_new_tokens=3, num_sub_batches=2, kv_cache="host")
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_training_and_generating_emit_no_future_warning(family, tmp_path):
    """transformers 5 renamed the KV-cache argument of its mask functions and decoder layers (``past_key_values`` ->
    ``cache``) and warns on every call that uses the old name: the engine passes the name the installed version
    takes, so a tiny training step and a generation with the cache warn nothing."""
    from dist_utils import tiny_config
    from fsdp_speedloader.app.trainer import Trainer

    ids, mask = _prompts(4, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        trainer = Trainer(tiny_config(tmp_path, steps=1, model={"family": family}))
        trainer.train()
        for kv_cache in ("device", "host"):
            out = generate(trainer.model, ids, mask, max_new_tokens=3, num_sub_batches=2, kv_cache=kv_cache)
            assert out.shape == (4, PROMPT_LEN + 3)


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_new_tokens=30), "exceeds the model's 32 positions"),
    (dict(input_ids=torch.zeros(4, 0, dtype=torch.long)), "empty prompts"),
    (dict(attention_mask=torch.ones(4, PROMPT_LEN + 1, dtype=torch.long)), "must match input_ids"),
    (dict(attention_mask=torch.ones(4, PROMPT_LEN, dtype=torch.long).index_fill_(0, torch.tensor([2]), 0)),
     r"row\(s\) \[2\] are all padding"),
    (dict(attention_mask=torch.ones(4, PROMPT_LEN, dtype=torch.long).index_fill_(1, torch.tensor([6]), 0)),
     "pad prompts on the LEFT"),
    (dict(num_sub_batches=3), "not num_sub_batches=3"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(kv_cache="disk"), "kv_cache='disk'"),
    (dict(kv_cache="host", kv_device_sub_batches=1), "applies to kv_cache='split' only"),
    (dict(kv_cache="split", kv_device_sub_batches=2), "1 to num_sub_batches - 1 = 1"),
    (dict(kv_cache="split", num_sub_batches=1), "needs num_sub_batches >= 2"),
    (dict(kv_cache="device", cpu_attention_sub_batches=1), "needs kv_cache='host' or 'split'"),
    (dict(kv_cache="host", cpu_attention_sub_batches=3), "the host holds the cache of 2 sub-batches"),
    (dict(kv_cache="split", kv_device_sub_batches=1, cpu_attention_sub_batches=2), "holds the cache of 1 sub-batch"),
    (dict(kv_cache="host", cpu_attention_sub_batches=-1), "integer >= 0"),
    (dict(input_ids=torch.full((4, PROMPT_LEN), VOCAB)), "outside the vocabulary"),
    (dict(do_sample=True, temperature=0.0), "temperature"),
    (dict(do_sample=True, top_p=1.5), "top_p"),
])
def test_bad_input_raises_before_any_work(kwargs, message):
    ids, mask = _prompts(4)
    model = _prepared("llama", 2)
    args = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, num_sub_batches=2) | kwargs
    counts, undo = count_collectives()
    try:
        with pytest.raises(ValueError, match=message):
            generate(model, **args)
    finally:
        undo()
    assert counts["unshard"] == 0


def test_unprepared_model_is_refused():
    with pytest.raises(ValueError, match="apply_speedloader"):
        generate(copy.deepcopy(_tiny("opt")), *_prompts(2), max_new_tokens=2, num_sub_batches=1)


def test_host_kv_arena_budget_error_names_the_settings():
    model = _prepared("llama", 2)
    with pytest.raises(ValueError, match="lower the batch"):
        generate(model, *_prompts(4), max_new_tokens=NEW, num_sub_batches=2, kv_cache="host",
                 host_memory_limit_bytes=1)


# --- world size 2 ----------------------------------------------------------------------------


def _sharded_generation(rank: int, world_size: int) -> list:
    torch.set_num_threads(1)
    out = []
    cases = itertools.product(("llama", "opt"), (("host", 0), ("host", 1), ("off", 0)), (False, True))
    for family, (kv_cache, on_cpu), offload in cases:
        model = _tiny(family)
        ids, mask = _prompts(4, seed=10 + rank)  # each rank its own prompts
        want = _reference(model, ids, mask)
        prepared = apply_speedloader(copy.deepcopy(model), mesh=cpu_mesh(), num_sub_batches=2, offload_params=offload)
        got = generate(prepared, ids, mask, max_new_tokens=NEW, num_sub_batches=2, kv_cache=kv_cache,
                       cpu_attention_sub_batches=on_cpu)
        out.append(bool(torch.equal(got, want)))
    # EOS on one rank only: the ranks agree to keep stepping until both are done (no hang), and the
    # rank that finished pads.
    ids, mask = _prompts(1, seed=20)
    ids, mask = ids.repeat(2, 1), mask.repeat(2, 1)
    eos = int(_reference(_tiny("opt"), ids, mask)[0, PROMPT_LEN + 1]) if rank == 0 else None  # rank 0 ends by step 2
    prepared = apply_speedloader(copy.deepcopy(_tiny("opt")), mesh=cpu_mesh(), num_sub_batches=1)
    got = generate(prepared, ids, mask, max_new_tokens=NEW, num_sub_batches=1, eos_token_id=eos, pad_token_id=5)
    out.append(tuple(got.shape))
    return out


@pytest.mark.slow
def test_generation_fsdp_sharded_on_two_ranks():
    results = run_distributed(_sharded_generation, 2)
    for rank, res in enumerate(results):
        assert all(res[:-1]), (rank, res)
        assert res[-1] == (2, PROMPT_LEN + NEW), (rank, res)


# --- CLI ---------------------------------------------------------------------------------------

CLI_TINY = ["logger=none", "device=cpu", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
            "model.intermediate_size=128", "max_new_tokens=6", "num_sub_batches=2", "warmup=false"]


def test_generate_yaml_composes_into_a_valid_config():
    from hydra import compose, initialize_config_dir

    from fsdp_speedloader.app.generate import GenerateConfig
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[1] / "conf"
    for overrides in ([], ["model=opt_tiny", "offload=params", "kv_cache=host", "prompts.min_prompt_len=4"],
                      ["model=opt_30b", "logger=none", "prompts.prompt_len=512"]):
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            dcfg = compose("generate", overrides=[*overrides, "output_dir=/tmp/x"])
        cfg = GenerateConfig.from_dict(OmegaConf.to_container(dcfg, resolve=True))
        assert cfg.model.name == (overrides[0].split("=")[1] if overrides else "llama_tiny")
    with pytest.raises(ValueError, match="kv_cache"):
        GenerateConfig.from_dict({"kv_cache": "disk"})
    with pytest.raises(ValueError, match="unknown key"):
        GenerateConfig.from_dict({"max_new_token": 3})
    with pytest.raises(ValueError, match="cpu_attention_sub_batches.*needs kv_cache=host or split"):
        GenerateConfig.from_dict({"cpu_attention_sub_batches": 1, "kv_cache": "device"})
    with pytest.raises(ValueError, match="at most the 1 sub-batches whose cache is on the host"):
        GenerateConfig.from_dict({"cpu_attention_sub_batches": 2, "kv_cache": "split", "num_sub_batches": 2,
                                  "kv_device_sub_batches": 1})
    assert GenerateConfig.from_dict({"param_dtype": "bf16"}).param_dtype == "bfloat16"  # as training's keys take it


def test_a_prompt_path_alone_means_a_prompt_file_and_show_generations_takes_all():
    from fsdp_speedloader.app.generate import GenerateConfig

    assert GenerateConfig.from_dict({}).prompts.source == "synthetic"
    assert GenerateConfig.from_dict({"prompts": {"path": "p.txt"}}).prompts.source == "file"
    assert GenerateConfig.from_dict({"prompts": {"source": "file", "path": "p.txt"}}).prompts.source == "file"
    with pytest.raises(ValueError, match=r"^prompts\.path: prompts\.source=synthetic reads no file; drop "
                                         r"prompts\.path=p\.txt or prompts\.source=synthetic$"):
        GenerateConfig.from_dict({"prompts": {"source": "synthetic", "path": "p.txt"}})
    with pytest.raises(ValueError, match="prompts.source=file needs prompts.path"):
        GenerateConfig.from_dict({"prompts": {"source": "file"}})
    assert GenerateConfig.from_dict({}).show_generations == 3
    assert GenerateConfig.from_dict({"show_generations": "all"}).show_generations is None
    assert GenerateConfig.from_dict({"show_generations": 0}).show_generations == 0
    with pytest.raises(ValueError, match="^show_generations: got -1; must be >= 0"):
        GenerateConfig.from_dict({"show_generations": -1})


def test_prompts_given_as_text():
    from fsdp_speedloader.app.data import ByteTokenizer
    from fsdp_speedloader.app.generate import GenerateConfig, build_prompts

    cfg = GenerateConfig.from_dict({"prompts": {"text": ["Once upon a time", "Hi"]}})  # the list alone: source text
    assert cfg.prompts.source == "text"
    texts, tokens = build_prompts(cfg, ByteTokenizer(), vocab_size=256)
    assert texts == ["Once upon a time", "Hi"] and tokens[1] == list(ByteTokenizer().encode("Hi"))
    assert GenerateConfig.from_dict({"prompts": {"text": "Hello"}}).prompts.text == ["Hello"]  # one prompt
    with pytest.raises(ValueError, match=r"^prompts\.text: give the prompts as prompts\.text or in a file"):
        GenerateConfig.from_dict({"prompts": {"text": ["a"], "path": "p.txt"}})
    with pytest.raises(ValueError, match=r"^prompts\.text: got \['a', ''\]; give a list of non-empty prompts"):
        GenerateConfig.from_dict({"prompts": {"text": ["a", ""]}})
    with pytest.raises(ValueError, match=r"^prompts\.text: prompts\.source=synthetic reads no prompts\.text"):
        GenerateConfig.from_dict({"prompts": {"source": "synthetic", "text": ["a"]}})


def test_generation_lines_show_the_first_prompts_on_one_line_each():
    from fsdp_speedloader.app.generate import generation_lines

    records = [{"index": 0, "prompt": "Hello", "prompt_tokens": [1], "completion": " world\nand more"},
               {"index": 1, "prompt": None, "prompt_tokens": [5, 6, 7], "completion": "\x00x"},
               {"index": 2, "prompt": "a" * 100 + "tail", "prompt_tokens": [1], "completion": "!"}]
    assert generation_lines(records, 2) == [
        "[0] 'Hello' -> ' world\\nand more'", "[1] <3 random tokens> -> '\\x00x'",
        "(1 more in the jsonl; show_generations=all prints every one)"]
    every = generation_lines(records, None)
    assert len(every) == 3 and every[2] == "[2] ...'" + "a" * 76 + "tail' -> '!'"


def test_cli_generates_prompts_from_a_file(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "Hello world"}\n{"text": "The capital of France is"}\n{"text": "abc"}\n'
                       '{"text": "xyz"}\n')
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["FSDP_SPEEDLOADER_PROGRESS"] = "1"  # the bar over the decoding steps, though stderr is a pipe
    proc = subprocess.run([sys.executable, "-m", "fsdp_speedloader.app.generate", *CLI_TINY,  # the path: a file
                           f"prompts.path={prompts}", "kv_cache=host", "cpu_attention_sub_batches=1",
                           f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in lines] == ["Hello world", "The capital of France is", "abc", "xyz"]
    assert all(len(r["completion_tokens"]) <= 6 and isinstance(r["completion"], str) for r in lines)
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["prefill_tokens_per_s"] > 0 and metrics["decode_tokens_per_s"] > 0
    assert "decode" in proc.stderr + proc.stdout  # the throughput line
    out = proc.stdout + proc.stderr
    order = [out.find(s) for s in ("setting up:", "building the model:", "generating:", "generate: ")]
    assert -1 not in order and order == sorted(order), out[-3000:]  # status lines first, then the bar
    assert "random weights (model=llama_tiny, no checkpoint= or model.path=): the completions are noise" in out
    assert "token" in proc.stderr[proc.stderr.find("generate: "):], proc.stderr[-2000:]
    # The first 3 generations on the console, one line each, and no metric logger's bare "step 0" line.
    shown = [line.split(" - ", 1)[1] for line in out.splitlines() if "][INFO] - [" in line or "more in the" in line]
    assert shown == [f"[{r['index']}] {r['prompt']!r} -> {r['completion']!r}" for r in lines[:3]] + [
        "(1 more in the jsonl; show_generations=all prints every one)"], out[-3000:]
    assert not any(line.rstrip().endswith(" - step 0") for line in out.splitlines()), out[-3000:]


def test_weights_over_the_host_memory_are_one_line_before_they_are_built(tmp_path):
    """On the CPU (or with offload=params) unquantized weights live in host memory: over the budget, the entry
    point ends with one line naming the GiB and what shrinks them, before the weights are materialised."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "fsdp_speedloader.app.generate", *CLI_TINY, "param_dtype=float32",
                           "host_memory_limit_gib=0.001", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: generation keeps the weights in host memory (on the CPU): "), errors[0]
    assert "parameters in float32 on this rank" in errors[0] and "weight_quant=int8 or int4" in errors[0]
    assert "param_dtype=bfloat16 halves them" in errors[0] and "host_memory_limit_gib" in errors[0]
    assert not (tmp_path / "run" / "generations.jsonl").exists()


def _pretrained_dir(path: Path, words: list[str], *, zero_norm: bool = False) -> Path:
    """A tiny LLaMA and a word-level tokenizer of ``words`` (EOS "<eos>") as a Hugging Face directory; with
    ``zero_norm`` every logit is 0, so greedy decoding always picks id 0."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    if zero_norm:
        torch.nn.init.zeros_(model.model.norm.weight)
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]").save_pretrained(path)
    return path


def _generate_cli(tmp_path: Path, *overrides: str) -> list[dict]:
    """The entry point on the CPU in a subprocess; the generations.jsonl records."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "fsdp_speedloader.app.generate", "logger=none", "device=cpu",
                           *overrides, "warmup=false", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "random weights" not in proc.stdout + proc.stderr  # the checkpoint's weights
    return [json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]


def test_cli_reads_prompts_with_the_pretrained_checkpoints_own_tokenizer(tmp_path):
    """model.path=DIR holding a Hugging Face tokenizer: prompts.text is encoded with it (not with bytes), the
    generations decoded with it."""
    hf = _pretrained_dir(tmp_path / "hf", ["[UNK]", "<eos>", "hello", "world", "the", "cat"])
    lines = _generate_cli(tmp_path, f"model.path={hf}", "prompts.text=[hello world,the cat]", "max_new_tokens=3")
    assert [(r["prompt"], r["prompt_tokens"]) for r in lines] == [("hello world", [2, 3]), ("the cat", [4, 5])]


def test_another_tokenizer_than_the_models_own_is_named_before_generating(tmp_path, caplog):
    """tokenizer= naming another vocabulary than the model's own (model.path's here; a checkpoint's alike) runs, as
    every id fits the model, but says so: its prompts and completions would read as noise. The model's own, given
    explicitly, and random weights (no tokenizer of their own) say nothing."""
    from fsdp_speedloader.app.generate import other_than_trained_with

    hf = _pretrained_dir(tmp_path / "hf", ["[UNK]", "<eos>", "hello", "world", "the", "cat"])
    other = _pretrained_dir(tmp_path / "other", ["<eos>", "[UNK]", "hello", "world"])  # 4 tokens, EOS 0
    why = other_than_trained_with(str(other), str(hf))
    assert why.startswith(f"tokenizer '{other}' (4 tokens, EOS 0) is not the model's own ('{hf}': 6 tokens, EOS 1)")
    assert other_than_trained_with(str(hf), str(hf)) is None and other_than_trained_with("bytes", "bytes") is None
    assert other_than_trained_with(str(other), str(tmp_path / "moved")) is None  # nothing here to compare with
    lines = _generate_cli(tmp_path, f"model.path={hf}", f"tokenizer={other}", "prompts.text=[hello world]",
                          "max_new_tokens=2")
    assert lines[0]["prompt_tokens"] == [2, 3]  # the other tokenizer's ids, as asked
    assert "(4 tokens, EOS 0) is not the model's own" in (tmp_path / "run" / "generate.log").read_text()


def test_cli_stops_at_every_eos_id_of_the_models_generation_config(tmp_path):
    """An instruct model's generation_config.json lists end tokens beside the tokenizer's EOS (Llama-3's <|eot_id|>):
    a sequence stops at any of them, as in Hugging Face's generate; it ran on to max_new_tokens."""
    from transformers import GenerationConfig

    hf = _pretrained_dir(tmp_path / "hf", ["<eot>", "<eos>", "[UNK]", "hello", "world", "the", "cat"],
                         zero_norm=True)  # greedy emits id 0, <eot>
    GenerationConfig(eos_token_id=[1, 0]).save_pretrained(hf)
    lines = _generate_cli(tmp_path, f"model.path={hf}", "prompts.text=[hello world,the cat]", "max_new_tokens=3")
    assert [r["completion_tokens"] for r in lines] == [[0], [0]]


def test_stop_token_ids_are_the_tokenizers_eos_and_its_generation_configs(tmp_path):
    from transformers import GenerationConfig

    from fsdp_speedloader.app.data import ByteTokenizer
    from fsdp_speedloader.app.generate import stop_token_ids

    tokenizer = ByteTokenizer()  # EOS 256
    assert stop_token_ids(tokenizer, None) == stop_token_ids(tokenizer, str(tmp_path)) == [256]  # no config
    GenerationConfig(eos_token_id=[7, 256, 9]).save_pretrained(tmp_path)
    assert stop_token_ids(tokenizer, str(tmp_path)) == [256, 7, 9]
    GenerationConfig(eos_token_id=2).save_pretrained(tmp_path)  # another tokenizer's EOS: its id means another token
    assert stop_token_ids(tokenizer, str(tmp_path)) == [256]


def test_wandb_online_without_a_key_fails_before_the_model_in_generate_and_tune(tmp_path, monkeypatch):
    """The training entry's check (one line at the entry point), before any model is built."""
    import fsdp_speedloader.app.generate as generate_mod
    import fsdp_speedloader.app.planning as planning_mod
    import fsdp_speedloader.app.tune as tune_mod
    from fsdp_speedloader.app.config import LoggerConfig
    from fsdp_speedloader.app.generate import GenerateConfig
    from dist_utils import tiny_config

    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(generate_mod, "build_model", no_model)
    monkeypatch.setattr(tune_mod, "tune_train_config", no_model)
    monkeypatch.setattr(planning_mod, "tune", no_model)
    online = LoggerConfig(backend="wandb", mode="online")
    message = r"^logger\.mode=online: no W&B API key .*use logger\.mode=offline or logger\.mode=auto$"
    with pytest.raises(ValueError, match=message):
        generate_mod.run(GenerateConfig(logger=online, output_dir=str(tmp_path / "gen")))
    with pytest.raises(ValueError, match=message):
        tune_mod.run(dataclasses.replace(tiny_config(tmp_path / "tune"), logger=online))


def test_a_tokenizer_beyond_the_models_vocabulary_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    import fsdp_speedloader.app.generate as generate_mod
    from fsdp_speedloader.app.generate import GenerateConfig

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(generate_mod, "build_model", no_model)
    cfg = GenerateConfig.from_dict({"model": {"vocab_size": 100}, "tokenizer": "bytes", "logger": {"backend": "none"},
                                    "prompts": {"text": ["zebra"]}, "output_dir": str(tmp_path)})
    with pytest.raises(ValueError, match=r"^tokenizer: the prompts' token ids reach 122, outside the model's "
                                         r"vocabulary of 100 ids"):
        generate_mod.run(cfg)


def test_prompt_files_and_left_padding(tmp_path):
    from fsdp_speedloader.app.generate import left_pad, read_prompt_file

    (tmp_path / "p.txt").write_text("first prompt\n second\n")
    assert read_prompt_file(str(tmp_path / "p.txt")) == ["first prompt", " second"]  # one prompt per line, as written
    (tmp_path / "gap.txt").write_text("first prompt\n\nsecond\n")
    with pytest.raises(ValueError, match="line 2 of .*gap.txt is empty"):  # skipping it would shift every output
        read_prompt_file(str(tmp_path / "gap.txt"))
    (tmp_path / "p.jsonl").write_text('{"q": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"^prompts\.text_field: line 1 of .*p\.jsonl: no field 'text' \(found "
                                         r"\['q'\]\); set prompts\.text_field to the field that holds the prompt$"):
        read_prompt_file(str(tmp_path / "p.jsonl"))
    (tmp_path / "list.jsonl").write_text('["a"]\n')
    with pytest.raises(ValueError, match=r"line 1 .*: no field 'text' \(found an array\)"):
        read_prompt_file(str(tmp_path / "list.jsonl"))
    # the words of training's text reader and the prepare tool: a number is not a prompt, bad bytes are one line
    (tmp_path / "number.jsonl").write_text('{"text": 7}\n')
    with pytest.raises(ValueError, match=r"^prompts\.text_field: line 1 of .*: field 'text' holds a number, not a "
                                         r"string$"):
        read_prompt_file(str(tmp_path / "number.jsonl"))
    (tmp_path / "latin1.txt").write_bytes(b"ok\ncaf\xe9\n")
    with pytest.raises(ValueError, match=r"^prompts\.path: line 2 of .*latin1\.txt: not UTF-8 \(unexpected "
                                         r"end of data at byte 4 of the line\); re-encode the file as UTF-8$"):
        read_prompt_file(str(tmp_path / "latin1.txt"))
    with pytest.raises(ValueError, match=f"^prompts.path: prompt file '{tmp_path / 'missing.txt'}' does not exist$"):
        read_prompt_file(str(tmp_path / "missing.txt"))
    (tmp_path / "p.csv").write_text("a\n")
    for not_prompts in (tmp_path / "p.csv", tmp_path):
        with pytest.raises(ValueError, match="is not a .txt or .jsonl file"):
            read_prompt_file(str(not_prompts))
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_nested_host_attention_routing_keeps_each_record():
    """attention_on_host inside attention_on_host: the outer routing stays, each block gets its own timing
    record (the innermost receives the calls), and the model's implementation comes back at the end."""
    from fsdp_speedloader.generation import host_attention

    config = _tiny("opt").config
    original = config._attn_implementation
    with host_attention.attention_on_host(config) as outer:
        routed = config._attn_implementation
        assert routed.startswith("speedloader_host+")
        with host_attention.attention_on_host(config) as inner:
            assert config._attn_implementation == routed and host_attention._times[-1] is inner
        assert host_attention._times == [outer] and host_attention._times[-1] is outer  # equal values, not equal records
    assert host_attention._times == [] and config._attn_implementation == original


def test_copies_that_fill_the_sub_batches_are_not_counted_in_the_throughput(tmp_path, caplog):
    # 3 prompts in 4 sub-batches: a 4th row, a copy, filled them, and the rates counted its tokens (16 rows for 3
    # prompts reported 5x the prompts' throughput)
    import fsdp_speedloader.app.generate as generate_mod
    from fsdp_speedloader.app.generate import GenerateConfig

    cfg = GenerateConfig.from_dict({"model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4,
                                              "intermediate_size": 128}, "device": "cpu", "warmup": False,
                                    "logger": {"backend": "none"}, "max_new_tokens": 3, "num_sub_batches": 4,
                                    "stop_at_eos": False, "prompts": {"text": ["one", "two", "three"]},
                                    "output_dir": str(tmp_path)})
    caplog.set_level("WARNING")
    figures = generate_mod.run(cfg)
    assert (figures["batch_size"], figures["prompts"], figures["filler_rows"]) == (4, 3, 1)
    total_s = figures["prefill_s"] + figures["decode_s"]
    assert figures["generated_tokens_per_s"] == pytest.approx(3 * figures["num_steps"] / total_s)
    assert figures["prefill_tokens_per_s"] == pytest.approx(3 * figures["prompt_len"] / figures["prefill_s"])
    assert any("1 filler row(s), copies of a prompt, fill this rank's 4 sub-batch(es)" in r.getMessage() for r in caplog.records)


def test_sampling_settings_without_sampling_warn_and_temperature_0_is_greedy(caplog):
    # temperature / top_k / top_p without do_sample were dropped without a word; temperature=0 (greedy to many users)
    # was refused although nothing samples
    from fsdp_speedloader.app.generate import SamplingConfig

    caplog.set_level("WARNING")
    SamplingConfig(temperature=0.5, top_k=3)
    assert [r.getMessage() for r in caplog.records] == [
        "sampling.temperature=0.5, sampling.top_k=3 apply only with sampling.do_sample=true: this run decodes greedily"]
    caplog.clear()
    SamplingConfig(temperature=0)
    SamplingConfig(do_sample=True, temperature=0.5, top_k=3)
    assert not caplog.records
    with pytest.raises(ValueError, match=r"sampling\.temperature: got 0; must be > 0 with sampling\.do_sample=true"):
        SamplingConfig(do_sample=True, temperature=0)
