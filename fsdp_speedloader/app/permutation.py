"""A keyed pseudo-random permutation of ``range(n)`` that is computed, not stored.

An epoch's sequence order used to be ``rng.permutation(num_sequences)``: 8 bytes per sequence of host memory in
every rank, growing with the corpus. :class:`KeyedPermutation` gives the same kind of order in O(1) memory: a
four-round Feistel network over the smallest even number of bits that covers ``n`` (a bijection on
``[0, 4**h)``), restricted to ``[0, n)`` by cycle walking (an index that lands at or past ``n`` is encrypted
again until it falls inside; the result is still a bijection, and ``4**h < 4 n`` keeps the walk short).
The round function is the splitmix64 finalizer keyed by four words drawn from ``numpy.random.SeedSequence(key)``.
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    # uint64 arithmetic wraps modulo 2**64, which is what the finalizer wants.
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class KeyedPermutation:
    """``perm[positions]`` -> the permuted indices (int64) of ``positions`` in ``[0, n)``; ``key``: a tuple of
    non-negative ints (e.g. ``(seed, epoch)``) that picks the permutation."""

    def __init__(self, n: int, key: tuple[int, ...]) -> None:
        if n < 1:
            raise ValueError(f"KeyedPermutation: n must be >= 1, got {n}")
        self.n = n
        self._half_bits = np.uint64(max(1, ((n - 1).bit_length() + 1) // 2))
        self._mask = np.uint64((1 << int(self._half_bits)) - 1)
        self._keys = np.random.SeedSequence(key).generate_state(_ROUNDS, dtype=np.uint64)

    def __len__(self) -> int:
        return self.n

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half_bits, x & self._mask
        for k in self._keys:
            left, right = right, left ^ (_mix(right ^ k) & self._mask)
        return (left << self._half_bits) | right

    def __getitem__(self, positions) -> np.ndarray:
        if isinstance(positions, slice):
            positions = np.arange(*positions.indices(self.n))
        x = np.asarray(positions, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"KeyedPermutation: positions must lie in [0, {self.n})")
        y = self._encrypt(x.astype(np.uint64))
        outside = y >= np.uint64(self.n)
        while outside.any():
            y[outside] = self._encrypt(y[outside])
            outside = y >= np.uint64(self.n)
        return y.astype(np.int64)


def check_same_seed(state: dict, seed: int) -> None:
    """A loader resumes in the order its data.seed drew: with another seed the rest of the epoch would repeat some
    sequences and skip others. (A checkpoint from before the seed was saved is not checked.)"""
    if "seed" in state and int(state["seed"]) != seed:
        raise ValueError(f"data.seed: the checkpoint's loader drew its order with data.seed={state['seed']}, this run "
                         f"has {seed}; resume with data.seed={state['seed']} (another seed would repeat some "
                         "sequences of the epoch and skip others)")
