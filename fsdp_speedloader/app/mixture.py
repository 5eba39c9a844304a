"""Several packed token datasets mixed by weight (``data.mixture``): resumable, at any world size.

The position is one counter per dataset, ``consumed[i]``: how many sequences of dataset i the whole job (all
ranks together) has taken. Everything else derives from it:

- which dataset the next global sample comes from: the one furthest behind its share,
  ``argmax_i(weight_i * (num_samples + 1) - consumed_i)`` (ties: the first), Megatron-Core's blending rule; so
  every prefix of the stream holds each dataset within one sample of its weight, and no random draw is kept;
- which sequence of dataset i the c-th one is: position ``c % n_i`` of epoch ``c // n_i``'s order, a
  :class:`KeyedPermutation` keyed by ``(seed, i, epoch)`` (no order array in memory).

Every step takes the next ``world_size * batch_size`` global samples and rank r keeps the r-th ``batch_size``
of them, as :class:`~fsdp_speedloader.app.data.TokenLoader` does. The counters are the same on every rank, so a
checkpoint saved on one world size resumes on another at the same global sample: a run of ``world_size=2,
batch_size=2`` and one of ``world_size=1, batch_size=4`` see the same samples in the same steps.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from fsdp_speedloader.app.permutation import KeyedPermutation, check_same_seed


class MixtureLoader:
    """``datasets``: (name, sequences) pairs, sequences indexable like a (num_sequences, seq_len) array;
    ``weights``: positive, normalised here."""

    def __init__(self, datasets: Sequence[tuple[str, object]], weights: Sequence[float], *, batch_size: int,
                 rank: int = 0, world_size: int = 1, seed: int = 0) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("data.mixture: needs one weight per dataset and at least one dataset")
        if not all(w > 0 and math.isfinite(w) for w in weights):
            raise ValueError(f"data.mixture: weights must be positive numbers, got {list(weights)}")
        self.names = [name for name, _ in datasets]
        self.sequences = [seqs for _, seqs in datasets]
        self.num_sequences = [len(s) for s in self.sequences]
        for name, n in zip(self.names, self.num_sequences):
            if n == 0:
                raise ValueError(f"data.mixture: {name!r} has fewer tokens than one sequence; lower data.seq_len "
                                 "or drop it from the mixture")
        self.seq_len = self.sequences[0].shape[1]
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.consumed = [0] * len(datasets)

    @property
    def epochs(self) -> list[int]:
        """Completed passes over each dataset."""
        return [c // n for c, n in zip(self.consumed, self.num_sequences)]

    def progress(self) -> dict:
        """For every log record: passes over the whole mixture (sequences taken over the datasets' sequences) and
        every dataset's tokens; then, dataset i by its place in data.mixture, its passes (``mixture/i/epoch``, a
        fraction) and the tokens the job has taken from it (``mixture/i/tokens``): a small dataset's repeats show."""
        record = {"epoch": sum(self.consumed) / sum(self.num_sequences),
                  "dataset_tokens": sum(self.num_sequences) * self.seq_len}
        for i, (taken, n) in enumerate(zip(self.consumed, self.num_sequences)):
            record[f"mixture/{i}/epoch"] = taken / n
            record[f"mixture/{i}/tokens"] = taken * self.seq_len
        return record

    def _take(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``count`` global samples: (dataset of each, sequence index of each), both (count,)."""
        datasets, counters = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
        consumed, weights = self.consumed, self.weights
        num_samples = sum(consumed)
        for j in range(count):
            num_samples += 1
            i = max(range(len(weights)), key=lambda d: weights[d] * num_samples - consumed[d])
            datasets[j], counters[j] = i, consumed[i]
            consumed[i] += 1
        sequence_ids = np.empty(count, dtype=np.int64)
        for i in np.unique(datasets).tolist():
            mask = datasets == i
            sequence_ids[mask] = self._sequence_ids(i, counters[mask])
        return datasets, sequence_ids

    def _sequence_ids(self, dataset: int, counters: np.ndarray) -> np.ndarray:
        n = self.num_sequences[dataset]
        epochs, positions = np.divmod(counters, n)
        out = np.empty_like(counters)
        for epoch in np.unique(epochs).tolist():
            mask = epochs == epoch
            out[mask] = KeyedPermutation(n, (self.seed, dataset, epoch))[positions[mask]]
        return out

    def next_batch(self) -> dict[str, torch.Tensor]:
        datasets, sequence_ids = self._take(self.world_size * self.batch_size)  # (world_size * batch_size,)
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        datasets, sequence_ids = datasets[mine], sequence_ids[mine]  # (batch_size,)
        rows = np.empty((self.batch_size, self.seq_len), dtype=np.int64)  # (b, s)
        for i in np.unique(datasets).tolist():
            mask = datasets == i
            rows[mask] = self.sequences[i][sequence_ids[mask]]
        input_ids = torch.from_numpy(rows)
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    def state_dict(self) -> dict:
        return {"mixture": [{"path": name, "weight": w, "num_sequences": int(n), "consumed": int(c)}
                            for name, w, n, c in zip(self.names, self.weights, self.num_sequences, self.consumed)],
                "seed": int(self.seed)}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("mixture")
        if saved is None:
            raise ValueError("data.mixture: the checkpoint was saved by a run without data.mixture; resume with "
                             "that run's data settings, or start fresh: checkpoint.resume=null or another "
                             "checkpoint.dir")
        if len(saved) != len(self.names):
            raise ValueError(f"data.mixture: the checkpoint mixes {len(saved)} datasets, this run {len(self.names)}; "
                             "resume with the same data.mixture")
        for i, (entry, name, w, n) in enumerate(zip(saved, self.names, self.weights, self.num_sequences)):
            if int(entry["num_sequences"]) != n:
                raise ValueError(f"data.mixture[{i}]: the checkpoint's dataset {entry['path']!r} gave "
                                 f"{entry['num_sequences']} sequences, {name!r} gives {n}; resume with the same "
                                 "datasets, in the same order, and the same data.seq_len")
            if not math.isclose(float(entry["weight"]), w, rel_tol=1e-9):
                raise ValueError(f"data.mixture[{i}]: the checkpoint's weight share is {entry['weight']:.6g}, this "
                                 f"run's {w:.6g}; resume with the same data.mixture weights")
        check_same_seed(state, self.seed)
        self.consumed = [int(entry["consumed"]) for entry in saved]
