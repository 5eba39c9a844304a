"""The torch versions the seam was read against, declared once, and the warning outside them.

Every private FSDP2 name, signature and source line in ``contract.py`` was read in the releases of this
range (2.11 and 2.13). Another torch may still work (``require_fsdp2_internals`` checks the names; each
fast path falls back, counted and warned, when FSDP2 does not behave as read); it is not tested.
"""

from __future__ import annotations

import operator
import re
import warnings
from typing import Optional

import torch

TESTED_TORCH = (">=2.11", "<2.14")  # (major, minor) bounds; a pre-release of 2.14 is outside

_COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq}
_warned = False


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.13.0+cpu" -> (2, 13); (0, 0) when unreadable."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def is_tested_torch(version: Optional[str] = None) -> bool:
    """Whether ``version`` (default: the installed torch) lies in ``TESTED_TORCH``."""
    release = _release(torch.__version__ if version is None else version)
    for bound in TESTED_TORCH:
        op, number = re.fullmatch(r"(>=|>|<=|<|==)(\d+\.\d+)", bound).groups()
        if not _COMPARE[op](release, _release(number)):
            return False
    return True


def check_torch_version() -> bool:
    """Warns once per process when the installed torch is outside ``TESTED_TORCH``; returns whether inside."""
    global _warned
    if is_tested_torch():
        return True
    if not _warned:
        _warned = True
        warnings.warn(
            f"fsdp_speedloader reaches into FSDP2's private state as read in torch {', '.join(TESTED_TORCH)}; "
            f"this is torch {torch.__version__}, which is not tested. Its fast paths fall back to FSDP2's own "
            "(with a warning) where FSDP2 does not behave as read; fsdp_speedloader.fsdp2.fast_path_stats() "
            "shows which engaged", stacklevel=2)
    return False
