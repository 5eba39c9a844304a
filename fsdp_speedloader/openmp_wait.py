"""How OpenMP's idle threads wait, chosen before torch loads OpenMP (which reads it once, then).

A rank that keeps its optimizer states on the host steps AdamW with a team of OpenMP threads. By default (GNU
OpenMP, which torch's Linux wheels use) those threads spin for a while after every parallel region before they
sleep. Where several ranks share one host, their spinning teams take the cores that the ranks' launching threads need
to keep their GPUs fed, and one late rank holds up every collective. ``OMP_WAIT_POLICY=PASSIVE`` makes idle threads
sleep at once. It is set here, where torchrun runs several ranks on this host and the user chose neither
``OMP_WAIT_POLICY`` nor ``GOMP_SPINCOUNT``. It is not set for one process alone, which is left as it was.

Nothing here imports torch: the package imports this module first, so that ``python -m fsdp_speedloader.app.train``
(and any script that imports ``fsdp_speedloader`` before ``torch``) starts OpenMP with the choice in place. Once
torch is loaded the choice can no longer take effect, so it is not made then (``GOMP_SPINCOUNT=300000`` restores
GNU OpenMP's default wait).
"""

from __future__ import annotations

import os
import sys
from typing import MutableMapping, Optional

USER_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

# What prefer_passive_wait decided when the package was imported: the value it set, or None. The trainer logs it.
chosen: Optional[str] = None


def prefer_passive_wait(environ: MutableMapping[str, str] = os.environ,
                        modules: Optional[dict] = None) -> Optional[str]:
    """Sets ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` where torchrun runs more than one rank on this host
    (``LOCAL_WORLD_SIZE`` > 1), neither of :data:`USER_CHOICES` is set, and torch is not yet loaded (``modules``:
    default ``sys.modules``); returns what it set, or None."""
    modules = sys.modules if modules is None else modules
    if "torch" in modules or any(name in environ for name in USER_CHOICES):
        return None
    try:
        local_ranks = int(environ.get("LOCAL_WORLD_SIZE") or 1)
    except ValueError:  # not ours to judge; torchrun reports it
        return None
    if local_ranks <= 1:
        return None
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "PASSIVE"


def missed(environ: MutableMapping[str, str] = os.environ) -> bool:
    """True where the rule applies but came too late: torch was imported before the package, so OpenMP started
    spinning (a script of the user's own that imports torch first)."""
    return chosen is None and prefer_passive_wait(dict(environ), modules={}) is not None
