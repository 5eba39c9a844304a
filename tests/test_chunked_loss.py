"""The canonical schedule's chunked head loss (``models.chunked_loss``) against the unmodified model's own loss.

For every family the loss and every gradient equal Hugging Face's (fp32, CPU), chunks that do not divide the tokens
included; no tensor as large as the full logits is ever made; the head's ``forward`` is the class's again after
the call; a family whose head the chunking cannot reproduce (Gemma-3's soft-capped logits) keeps its own loss. Then
the canonical step on an FSDP2-sharded model with the chunked head gives the reference gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine_cases import (FAMILY_CASES, SEQ_LEN, VOCAB, assert_grads_close, batch, cpu_mesh, reference_grads,
                          tiny_family_model, tiny_model)
from fsdp_speedloader import parallel
from fsdp_speedloader.app.canonical import canonical_forward_backward
from fsdp_speedloader.app.trainer import num_label_tokens
from fsdp_speedloader.models.chunked_loss import LinearCrossEntropy, causal_lm_loss, chunked_loss_unsupported

CHUNK = 7  # does not divide the 2 x SEQ_LEN tokens of a batch


class LargestLogits(TorchDispatchMode):
    """The most rows of any tensor over the vocabulary (logits, their fp32 copy, their gradient) an operator
    returned inside the scope."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == VOCAB:
                self.rows = max(self.rows, t.numel() // VOCAB)
        return out


def _grads(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILY_CASES))
def test_loss_and_gradients_equal_the_model_s_own(family):
    model = tiny_family_model(family, layers=2)
    ids, labels = batch(1)
    num_tokens = num_label_tokens(labels)
    ref = copy.deepcopy(model)
    want = ref(input_ids=ids, labels=labels, num_items_in_batch=num_tokens).loss
    want.backward()
    got = causal_lm_loss(model, ids, labels, num_tokens=num_tokens, chunk_tokens=CHUNK)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert_grads_close(model, _grads(ref), rtol=1e-5)
    assert "forward" not in model.get_output_embeddings().__dict__  # the class's forward again
    assert (chunked_loss_unsupported(model) is None) == (family != "gemma3")


def test_no_full_logits_are_made():
    model = tiny_model("llama", layers=2)
    ids, labels = batch(1, sub_batch=16)  # 256 tokens
    weight_rows = model.config.hidden_size  # the head's weight transposed, (h, VOCAB), is such a tensor too
    with LargestLogits() as own:
        model(input_ids=ids, labels=labels).loss.backward()
    assert own.rows == ids.numel() > weight_rows  # the model's own loss holds every token's logits at once
    model.zero_grad(set_to_none=True)
    with LargestLogits() as chunked:
        causal_lm_loss(model, ids, labels, chunk_tokens=CHUNK).backward()
    assert chunked.rows == max(CHUNK, weight_rows)


def test_without_gradients_the_loss_alone_and_none_kept():
    model = tiny_model("llama", layers=2)
    ids, labels = batch(1)
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels).loss
        got = causal_lm_loss(model, ids, labels, chunk_tokens=CHUNK)  # num_tokens None: this batch's count
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())


def test_validation_form_leaves_out_the_router_loss():
    model = tiny_family_model("mixtral", layers=2)
    ids, labels = batch(1)
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
        token_loss = out.loss - model.router_aux_loss_coef * out.aux_loss
        for chunk in (0, CHUNK):  # the model's own loss and the chunked one
            got = causal_lm_loss(model, ids, labels, chunk_tokens=chunk, router_loss=False)
            torch.testing.assert_close(got, token_loss, rtol=1e-6, atol=1e-6)


def test_the_head_s_forward_comes_back_after_an_error():
    model = tiny_model("llama", layers=2)
    ids, labels = batch(1)
    with pytest.raises(IndexError):
        causal_lm_loss(model, ids + VOCAB, labels, chunk_tokens=CHUNK)  # ids past the embedding
    assert "forward" not in model.get_output_embeddings().__dict__


def test_linear_cross_entropy_scales_its_gradients_by_the_incoming_one():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 8, generator=gen, requires_grad=True)
    weight = torch.randn(16, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, 16, (10,), generator=gen)
    labels[3] = -100
    (3.0 * LinearCrossEntropy.apply(hidden, weight, labels, 4)).backward()
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    (3.0 * torch.nn.functional.cross_entropy(h @ w.T, labels, ignore_index=-100, reduction="sum")).backward()
    torch.testing.assert_close(hidden.grad, h.grad)
    torch.testing.assert_close(weight.grad, w.grad)


@pytest.mark.parametrize("sync", ["every", "last"])
def test_canonical_step_with_the_chunked_head_gives_the_reference_gradients(sync):
    model = tiny_model("llama", layers=2)
    ids, labels = batch(2)
    _, ref = reference_grads(model, [(ids, labels)])
    parallel.apply_fsdp(model, cpu_mesh(), units=[[b] for b in model.model.layers])
    canonical_forward_backward(model, ids, labels, sub_batch_size=ids.shape[0] // 2,
                               num_tokens=num_label_tokens(labels), gradient_sync=sync, loss_chunk_tokens=CHUNK)
    assert_grads_close(model, ref, rtol=1e-5)
    assert SEQ_LEN % CHUNK  # the chunks straddle the rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_in_bf16_the_chunked_head_equals_the_model_s_and_holds_far_less():
    """LLaMA's 32,000-token vocabulary, 8,192 tokens: the model's own loss holds about 10 bytes per logit at its
    peak (2.6 GB here); the chunked head one chunk's. Loss and gradients within bf16 noise of the model's own."""
    from fsdp_speedloader.models import ModelConfig, build_model

    cfg = ModelConfig(family="llama", hidden_size=512, num_layers=2, num_heads=8, intermediate_size=1376,
                      vocab_size=32000, max_position_embeddings=2048)
    base = build_model(cfg, device="cpu", seed=0).cuda().to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (4, 2048), generator=torch.Generator().manual_seed(0)).cuda()
    runs = {}
    for chunk in (0, 1024):
        model = copy.deepcopy(base)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = causal_lm_loss(model, ids, ids, chunk_tokens=chunk)
        loss.backward()
        torch.cuda.synchronize()
        runs[chunk] = (loss.detach().float(), torch.cuda.max_memory_allocated() - before, _grads(model))
        del model, loss
    (own_loss, own_peak, own_grads), (loss, peak, grads) = runs[0], runs[1024]
    logit_bytes = ids.numel() * cfg.vocab_size * 2  # the bf16 logits alone
    assert own_peak - peak > 2 * logit_bytes, (own_peak, peak)
    torch.testing.assert_close(loss, own_loss, rtol=2e-3, atol=0)
    for name, want in own_grads.items():
        err = (grads[name].float() - want.float()).norm() / want.float().norm()
        assert err < 2e-2, f"{name}: relative error {err:.3e}"
