"""Document-aware packing (``data.document_mask``): exact against the unmodified model run on each document alone.

A packed row is documents joined with EOS (``app/data.py``). With per-document ``position_ids``
(``apply_document_mask``) the layer-major model's loss, each document's share of it and every gradient equal those of
the unmodified Hugging Face model run on each document ALONE (no packing, no mask, positions from 0), summed over the
documents: fp32, CPU, loss rtol 1e-6, gradients relative error < 1e-5 (``assert_grads_close``). Rows hold different
document layouts, so a sub-batch given another's positions fails. Also: the family's own forward on the packed batch
(the canonical schedule's path) gives each document's logits, the canonical step's gradients, and the refusals.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine_cases import VOCAB, assert_grads_close, cpu_mesh, tiny_family_model, tiny_model
from fsdp_speedloader import apply_speedloader
from fsdp_speedloader.app.data import apply_document_mask, document_position_ids
from fsdp_speedloader.app.canonical import canonical_forward_backward
from fsdp_speedloader.app.trainer import num_label_tokens
from fsdp_speedloader.parallel import apply_fsdp

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

EOS = VOCAB - 1
SEQ = 24
# Document lengths per row (the last one is cut by the row's end, as a packed loader cuts it); each document but
# the last ends with EOS. One row is a single document, one starts with a one-token document.
LAYOUTS = [(7, 9, 8), (24,), (1, 10, 13), (12, 12), (5, 5, 5, 9), (20, 4)]


def packed_batch(num_rows: int, *, seed: int = 0) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """(num_rows, SEQ) packed ids and each row's documents (1-D id tensors, EOS included where it ends one)."""
    gen = torch.Generator().manual_seed(seed)
    rows, documents = [], []
    for r in range(num_rows):
        lengths = LAYOUTS[r % len(LAYOUTS)]
        docs = []
        for k, n in enumerate(lengths):
            doc = torch.randint(0, EOS, (n,), generator=gen)  # no EOS inside a document
            if k + 1 < len(lengths):
                doc[-1] = EOS
            docs.append(doc)
        rows.append(torch.cat(docs))
        documents.append(docs)
    return torch.stack(rows), documents


def per_document_reference(model, documents: list[list[torch.Tensor]]):
    """The unmodified model on each document alone: (per-document summed token losses, label-token count, grads of
    the packed batch's mean loss = sum over documents of their summed losses / all their targets)."""
    ref = copy.deepcopy(model)
    docs = [d for row in documents for d in row]
    total_targets = sum(len(d) - 1 for d in docs)
    sums = []
    for d in docs:
        if len(d) < 2:  # a one-token document predicts nothing
            sums.append(torch.zeros(()))
            continue
        loss = ref(input_ids=d[None], labels=d[None]).loss * (len(d) - 1)  # summed over the document's targets
        (loss / total_targets).backward()
        sums.append(loss.detach())
    return sums, total_targets, {name: p.grad.clone() for name, p in ref.named_parameters()}


def test_positions_restart_after_each_eos():
    ids = torch.tensor([[5, EOS, 6, 7, EOS, EOS, 8], [EOS, 1, 2, 3, 4, 5, 6]])
    assert document_position_ids(ids, EOS).tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5]]
    batch = apply_document_mask({"input_ids": ids, "labels": ids.clone()}, EOS)
    # A document's first token is no target: predicting it would read the document before.
    assert batch["labels"].tolist() == [[-100, EOS, -100, 7, EOS, -100, -100], [-100, -100, 2, 3, 4, 5, 6]]
    packed, documents = packed_batch(len(LAYOUTS))
    positions = document_position_ids(packed, EOS)
    for row, docs in zip(positions, documents):
        assert row.tolist() == [p for d in docs for p in range(len(d))]


@pytest.mark.parametrize("family,num_sub_batches,blocks_per_unit,store", [
    ("llama3", 3, 1, "device"), ("llama3", 1, 2, "host"), ("qwen2", 3, 2, "host"), ("qwen3", 2, 1, "device"),
    ("mistral", 3, 1, "device")])  # mistral: window 8, shorter than most documents
def test_layer_major_equals_each_document_alone(family, num_sub_batches, blocks_per_unit, store):
    model = tiny_family_model(family, max_position_embeddings=SEQ)
    ids, documents = packed_batch(2 * num_sub_batches, seed=num_sub_batches)
    sums, total_targets, ref_grads = per_document_reference(model, documents)
    batch = apply_document_mask({"input_ids": ids, "labels": ids.clone()}, EOS)
    assert num_label_tokens(batch["labels"]) == total_targets
    apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=num_sub_batches, blocks_per_unit=blocks_per_unit,
                      activation_store=store)
    loss = model(**batch).loss
    loss.backward()
    torch.testing.assert_close(loss.detach(), torch.stack(sums).sum() / total_targets, rtol=1e-6, atol=0)
    assert_grads_close(model, ref_grads)

    # Each document's own loss, forward only: the packed batch with only that document's targets.
    flat = [(r, start, len(d)) for r, docs in enumerate(documents)
            for start, d in zip(torch.tensor([0, *map(len, docs)]).cumsum(0).tolist(), docs)]
    with torch.no_grad():
        for (r, start, n), want in zip(flat, sums):
            if n < 2:
                continue
            labels = torch.full_like(ids, -100)
            labels[r, start + 1 : start + n] = ids[r, start + 1 : start + n]
            got = model(input_ids=ids, labels=labels, position_ids=batch["position_ids"]).loss * (n - 1)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_familys_own_forward_gives_each_documents_logits():
    """What the canonical schedule runs: the unmodified model on the packed rows with the positions, without a KV
    cache (Hugging Face looks for packed positions only then; the trainer passes use_cache=False)."""
    model = tiny_family_model("qwen3", max_position_embeddings=SEQ)
    ids, documents = packed_batch(3)
    positions = document_position_ids(ids, EOS)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits  # (3, SEQ, V)
        for r, docs in enumerate(documents):
            start = 0
            for d in docs:
                alone = model(input_ids=d[None]).logits[0]
                torch.testing.assert_close(packed[r, start : start + len(d)], alone, rtol=1e-5, atol=1e-5)
                start += len(d)


def test_canonical_step_equals_each_document_alone():
    """``canonical_forward_backward`` (FSDP2 gradient accumulation, the trainer's canonical step) splits the
    positions with its micro-batches."""
    model = tiny_family_model("llama3", max_position_embeddings=SEQ)
    ids, documents = packed_batch(4)
    sums, total_targets, ref_grads = per_document_reference(model, documents)
    batch = apply_document_mask({"input_ids": ids, "labels": ids.clone()}, EOS)
    apply_fsdp(model, cpu_mesh(), units=[[b] for b in model.model.layers])
    loss = canonical_forward_backward(model, batch["input_ids"], batch["labels"], sub_batch_size=2,
                                      num_tokens=num_label_tokens(batch["labels"]),
                                      position_ids=batch["position_ids"])
    torch.testing.assert_close(loss, torch.stack(sums).sum() / total_targets, rtol=1e-6, atol=0)
    assert_grads_close(model, ref_grads)


def test_families_without_per_document_positions_are_refused():
    ids, _ = packed_batch(2)
    positions = document_position_ids(ids, EOS)
    for model in (tiny_model("opt"), tiny_family_model("mixtral", max_position_embeddings=SEQ)):
        apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=1)
        with pytest.raises(ValueError, match=r"position_ids .* supported for LlamaForCausalLM.*not (OPT|Mixtral)"):
            model(input_ids=ids, labels=ids, position_ids=positions)
    model = apply_speedloader(tiny_family_model("llama3", max_position_embeddings=SEQ), mesh=cpu_mesh(),
                              num_sub_batches=1)
    with pytest.raises(ValueError, match="position_ids has shape"):
        model(input_ids=ids, labels=ids, position_ids=positions[:, :4])
