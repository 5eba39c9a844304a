"""Layer-major generation of every family: greedy tokens equal Hugging Face ``generate``; sliding-window layers
keep only their window.

Families, each through its unmodified Hugging Face class (tiny random configs of ``engine_cases.FAMILY_CASES``,
3 layers, fp32, CPU): Llama-3.x (GQA, llama3 rope scaling, tied embeddings), Qwen2.5 (q/k/v biases), Qwen2
with ``use_sliding_window`` (built here: full and sliding layers sharing one rotary table), Qwen3 (q/k RMSNorm),
Mistral with a window (8) and without, Gemma-3 text (sliding (window 4) and global layers, each type with its own
mask and rotary table, logit soft-capping, tied embeddings), Mixtral and Qwen3-MoE (routed experts). Prompts are ``test_generate``'s: left-padded to
lengths 1 to 7, and with 10 new tokens every window is exceeded (Gemma-3's already by the prompt). The reference
is the same initialised model, deep-copied, through its own ``generate`` (``use_cache=False`` for
``kv_cache='off'``).
"""

from __future__ import annotations

import copy

import pytest
import torch

import fsdp_speedloader.generation.kv_cache as kv_module
from engine_cases import VOCAB, cpu_mesh, tiny_family_model
from fsdp_speedloader import apply_speedloader
from fsdp_speedloader.generation.generate import generate
from fsdp_speedloader.generation.sampling import select_tokens
from fsdp_speedloader.models import get_adapter
from test_generate import NEW, PROMPT_LEN, _prompts, _reference

_MODELS: dict = {}


def _qwen2_sliding(sliding_window: int = 4) -> torch.nn.Module:
    """Qwen2 with ``use_sliding_window``: layer 0 full, layers 1 and 2 sliding (ModelConfig does not offer it)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(1)
        return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                            max_position_embeddings=64, use_sliding_window=sliding_window is not None,
                                            sliding_window=sliding_window, max_window_layers=1,
                                            attn_implementation="sdpa"))


BUILDERS = {
    "llama3": lambda **kw: tiny_family_model("llama3", layers=3, **kw),
    "qwen2": lambda **kw: tiny_family_model("qwen2", layers=3, **kw),
    "qwen2_sliding": _qwen2_sliding,
    "qwen3": lambda **kw: tiny_family_model("qwen3", layers=3, **kw),
    "mistral": lambda **kw: tiny_family_model("mistral", layers=3, **kw),  # sliding_window 8
    "mistral_no_window": lambda **kw: tiny_family_model("mistral", layers=3, sliding_window=None, **kw),
    "gemma3": lambda **kw: tiny_family_model("gemma3", layers=3, **kw),  # sliding_window 4
    # Mixtures of experts, the load-balancing loss off: with output_router_logits=True Hugging Face's own generate
    # (the reference) fails on padded prompts in transformers 5.23 (its loss over the padded router logits)
    "mixtral": lambda **kw: tiny_family_model("mixtral", layers=3, output_router_logits=False, **kw),
    "qwen3_moe": lambda **kw: tiny_family_model("qwen3_moe", layers=3, output_router_logits=False, **kw),
}
WINDOWED = ("qwen2_sliding", "mistral", "gemma3")


def _tiny(name: str) -> torch.nn.Module:
    """Built once per case; tests deep-copy it."""
    if name not in _MODELS:
        _MODELS[name] = BUILDERS[name]()
    return _MODELS[name]


def _unwindowed(name: str) -> torch.nn.Module:
    """The same weights with every window longer than the sequence: what ignoring the window would generate."""
    model = _qwen2_sliding(sliding_window=None) if name == "qwen2_sliding" else BUILDERS[name](sliding_window=64)
    model.load_state_dict(_tiny(name).state_dict())
    return model


def _kv_modes(num_sub_batches: int) -> list[tuple[str, dict]]:
    """Every KV mode of the API at N sub-batches, host sub-batches attending next to their cache included ('auto'
    is 'device' without CUDA)."""
    n = num_sub_batches
    modes = [("auto", {}), ("device", {}), ("host", {}), ("host", dict(cpu_attention_sub_batches=n)), ("off", {})]
    if n > 1:
        modes += [("split", dict(kv_device_sub_batches=1)),
                  ("split", dict(kv_device_sub_batches=n - 1, cpu_attention_sub_batches=1))]
    return modes


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("family", list(BUILDERS))
def test_greedy_parity_with_hugging_face(family):
    """N in {1, 2, 4} x every KV mode, on one prepared model per N: the tokens equal HF's exactly."""
    ids, mask = _prompts(4)
    cached, recomputed = _reference(_tiny(family), ids, mask), _reference(_tiny(family), ids, mask, use_cache=False)
    if family in WINDOWED:  # the windows change the tokens here: parity is not by accident
        assert not torch.equal(cached, _reference(_unwindowed(family), ids, mask))
    for n_sub in (1, 2, 4):
        model = apply_speedloader(copy.deepcopy(_tiny(family)), mesh=cpu_mesh(), num_sub_batches=n_sub)
        for kv_cache, kwargs in _kv_modes(n_sub):
            got = generate(model, ids, mask, max_new_tokens=NEW, num_sub_batches=n_sub, kv_cache=kv_cache, **kwargs)
            want = recomputed if kv_cache == "off" else cached
            assert torch.equal(got, want), (family, n_sub, kv_cache, kwargs, got[:, PROMPT_LEN:], want[:, PROMPT_LEN:])


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_parity_with_offload_and_two_blocks_per_unit(family):
    """Units of two layers of different types (Gemma-3: a sliding and a global one), weights offloaded,
    activations through the host."""
    ids, mask = _prompts(4, seed=1)
    want = _reference(_tiny(family), ids, mask)
    model = apply_speedloader(copy.deepcopy(_tiny(family)), mesh=cpu_mesh(), num_sub_batches=2, offload_params=True,
                              blocks_per_unit=2, activation_store="host")
    for kv_cache in ("device", "host", "split"):
        got = generate(model, ids, mask, max_new_tokens=NEW, num_sub_batches=2, kv_cache=kv_cache)
        assert torch.equal(got, want), kv_cache


def _record_updates(monkeypatch) -> list[tuple]:
    """(cache, layer, past, key positions handed to attention, positions its storage holds) of every KV update of
    the device and host caches."""
    seen = []
    for cls in (kv_module.DeviceKVCache, kv_module.HostKVCache):
        def spied(self, i, layer, key, value, _update=cls.update):
            keys, values = _update(self, i, layer, key, value)
            seen.append((self, layer, self.past, keys.shape[2], self.positions_kept(layer)))
            return keys, values

        monkeypatch.setattr(cls, "update", spied)
    return seen


@pytest.mark.parametrize("family,kv_cache", [("gemma3", "device"), ("gemma3", "host"), ("mistral", "split"),
                                             ("qwen2_sliding", "host")])
def test_sliding_layers_keep_only_their_window(family, kv_cache, monkeypatch):
    """Prompt + new tokens exceed the window: a sliding layer's storage holds ``window`` positions, a full layer's
    every position (one more than Hugging Face's cache holds after its last step: the slot of the position that
    comes next; its ``DynamicSlidingWindowLayer`` keeps ``window - 1``); each step attends to exactly the keys
    Hugging Face's cache hands its attention; the host cache moves only windows over the link; the tokens are
    Hugging Face's."""
    ids, mask = _prompts(4, seed=2)
    ref = copy.deepcopy(_tiny(family))
    ref.generation_config.eos_token_id, ref.generation_config.pad_token_id = None, 0
    out = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                       return_dict_in_generate=True)
    config, capacity = ref.config, PROMPT_LEN + NEW
    window = config.sliding_window
    assert window < capacity
    sliding = [layer for layer, t in enumerate(get_adapter(ref).layer_types) if t == "sliding_attention"]
    kept = {layer: window if layer in sliding else capacity for layer in range(config.num_hidden_layers)}
    assert sliding and [layer.keys.shape[-2] for layer in out.past_key_values.layers] == [
        k - 1 for k in kept.values()]

    model = apply_speedloader(copy.deepcopy(_tiny(family)), mesh=cpu_mesh(), num_sub_batches=2)
    seen = _record_updates(monkeypatch)
    got, stats = generate(model, ids, mask, max_new_tokens=NEW, num_sub_batches=2, kv_cache=kv_cache,
                          kv_device_sub_batches=1 if kv_cache == "split" else None, return_stats=True)
    assert torch.equal(got, out.sequences)

    caches = {cache for cache, *_ in seen}  # split: its host part and its device part
    assert len(caches) == (2 if kv_cache == "split" else 1)
    for cache in caches:
        assert {layer: storage for c, layer, _, _, storage in seen if c is cache} == kept
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    position_bytes = 2 * config.num_key_value_heads * head_dim * 4 * ids.shape[0]  # keys and values, fp32, batch
    assert stats.io["kv_cache_bytes"] == sum(kept.values()) * position_bytes
    for _, layer, past, length, _ in seen:
        if past == 0:
            assert length == PROMPT_LEN  # the prefill attends to the prompt's own keys, as without a cache
        else:  # DynamicSlidingWindowLayer: the last window - 1 cached positions and the new one
            assert length == (min(past, window - 1) if layer in sliding else past) + 1, (layer, past, length)
    if kv_cache == "host":  # fetched per step: what each layer keeps of the past, and the new position's slot
        fetched = sum(min(past + 1, kept[layer]) for past in range(PROMPT_LEN, capacity - 1) for layer in kept)
        assert stats.io["kv_h2d_bytes"] == fetched * position_bytes
        stored = sum(min(PROMPT_LEN, kept[layer]) for layer in kept) + (NEW - 1) * len(kept)
        assert stats.io["kv_d2h_bytes"] == stored * position_bytes


def test_gemma3_samples_from_soft_capped_logits():
    """Sampling draws from the logits the family's forward returns (Gemma-3: soft-capped at 0.5, which changes the
    distribution, not the argmax): the same draws as from Hugging Face's own logits with the same generator."""
    ids, mask = _prompts(4, seed=3)
    # A low temperature makes the draws sensitive to the cap (at 1.0 these near-uniform draws rarely change).
    new, seed, sample = 6, 11, dict(do_sample=True, temperature=0.05, top_k=None, top_p=None)

    def reference(model) -> torch.Tensor:
        generator, seq, seq_mask = torch.Generator().manual_seed(seed), ids, mask
        for _ in range(new):
            logits = model(input_ids=seq, attention_mask=seq_mask).logits[:, -1, :].float()
            token = select_tokens(logits, generator=generator, **sample)
            seq = torch.cat([seq, token[:, None]], dim=1)
            seq_mask = torch.cat([seq_mask, torch.ones_like(token)[:, None]], dim=1)
        return seq

    with torch.no_grad():
        want = reference(copy.deepcopy(_tiny("gemma3")))
        uncapped = copy.deepcopy(_tiny("gemma3"))
        uncapped.config.final_logit_softcapping = None
        assert not torch.equal(want, reference(uncapped))  # the cap shows in the draws
    model = apply_speedloader(copy.deepcopy(_tiny("gemma3")), mesh=cpu_mesh(), num_sub_batches=2)
    for kv_cache in ("device", "host"):
        got = generate(model, ids, mask, max_new_tokens=new, num_sub_batches=2, kv_cache=kv_cache, seed=seed, **sample)
        assert torch.equal(got, want), kv_cache
