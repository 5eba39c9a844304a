"""The per-rank extra file of a step directory, ``extra_rank{r}.pt``: step, LR scheduler, data loader position, RNG
states and the W&B run id, as tensors and plain values only, so that it is read back with
``torch.load(weights_only=True)`` and a tampered file (a pickle naming code to run) is refused, never run.

The RNG states: torch's (CPU, CUDA) are tensors already; numpy's and python's are stored as a dict of a tensor and
numbers each (numpy's and python's own tuples, numpy's key an array, need more than plain values). Checkpoints of the
older format (those tuples) still load: numpy's array globals are allowed for them (they build arrays, run no code).
Every save checks that its file reads back so (:func:`save_extra`), so a state that would not fails the save, not the
resume that needs it.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import random
import re
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

EXTRA_FILE = "extra_rank{rank}.pt"
"""In every step directory, one per rank (``EXTRA_FILE.format(rank=r)``)."""


def _numpy_array_globals() -> list:
    """What ``torch.load(weights_only=True)`` must allow to read a numpy array (the RNG state of the older format):
    numpy's array reconstruction and dtypes, which build data, never call anything else."""
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    return [multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read_extra(path: str | os.PathLike) -> dict:
    """An ``extra_rank*.pt`` file, read with ``torch.load(weights_only=True)``: tensors and plain values only.

    The older format (numpy's RNG state as a numpy array, python's as a tuple) is read with numpy's array globals
    allowed as well (they build data and run no code) and a warning. Anything else, such as a class whose
    unpickling would run code, is refused: ValueError naming the file and what it holds.
    """
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as first:
        try:
            with torch.serialization.safe_globals(_numpy_array_globals()):
                extra = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(first))
            what = f"the global {found.group(1)}" if found else str(first).strip().splitlines()[-1]
            raise ValueError(f"checkpoint: {str(path)!r} holds more than tensors and plain values ({what}); refused, "
                             "since loading it could run code: resume only checkpoints written by this project, and "
                             "only from people you trust (docs/checkpoints.md#trust)") from None
        log.warning("%s is in the older format (numpy's RNG state as a numpy array); read with numpy's array types "
                    "allowed, the next save writes the current format", path)
        return extra


def rng_state(device: torch.device) -> dict:
    """Every RNG's state as tensors and plain values (``torch.load(weights_only=True)`` reads them)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
             "python": {"version": int(version), "internal": torch.tensor(internal, dtype=torch.int64),
                        "gauss_next": gauss_next}}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    numpy_state, python_state = state["numpy"], state["python"]
    if isinstance(numpy_state, dict):
        numpy_state = (numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])
    if isinstance(python_state, dict):
        python_state = (python_state["version"], tuple(python_state["internal"].tolist()), python_state["gauss_next"])
    np.random.set_state(numpy_state)  # the older format held numpy's and python's own tuples
    random.setstate(tuple(python_state))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_extra(extra: dict, path: Path) -> None:
    """``torch.save`` of ``extra``, checked first to read back with ``weights_only=True`` (a value that would not, such
    as a data loader state holding an object, fails this save rather than the resume that needs it)."""
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        raise TypeError(f"checkpoint: {path.name} would not load with weights_only=True "
                        f"({found.group(1) if found else e}); keep its states to tensors and plain values") from None
    path.write_bytes(buffer.getvalue())
