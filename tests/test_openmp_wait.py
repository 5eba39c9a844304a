"""OpenMP's wait policy, chosen at import where torchrun runs several ranks on one host (fsdp_speedloader/openmp_wait.py):
the rule, then real processes whose OpenMP runtime reports what it started with (``OMP_DISPLAY_ENV``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fsdp_speedloader.openmp_wait import prefer_passive_wait

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("environ, torch_loaded, expected", [
    ({"LOCAL_WORLD_SIZE": "4"}, False, "PASSIVE"),
    ({"LOCAL_WORLD_SIZE": "1"}, False, None),  # one process on this host: left as it was
    ({}, False, None),  # not under torchrun
    ({"LOCAL_WORLD_SIZE": "4", "OMP_WAIT_POLICY": "ACTIVE"}, False, None),  # the user's choice
    ({"LOCAL_WORLD_SIZE": "4", "GOMP_SPINCOUNT": "300000"}, False, None),  # the user's choice
    ({"LOCAL_WORLD_SIZE": "4"}, True, None),  # OpenMP has read its environment already
    ({"LOCAL_WORLD_SIZE": "x"}, False, None),
])
def test_the_rule(environ, torch_loaded, expected):
    env = dict(environ)
    assert prefer_passive_wait(env, {"torch": object()} if torch_loaded else {}) == expected
    assert env.get("OMP_WAIT_POLICY") == (expected or environ.get("OMP_WAIT_POLICY"))


def _spin_counts(text: str) -> list[str]:
    """GNU OpenMP's ``GOMP_SPINCOUNT`` as each process's runtime printed it at start (``OMP_DISPLAY_ENV=VERBOSE``)."""
    return re.findall(r"GOMP_SPINCOUNT = '(\d+)'", text)


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "WORLD_SIZE",
                        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    return {**env, "PYTHONPATH": str(REPO), "OMP_DISPLAY_ENV": "VERBOSE", "OMP_NUM_THREADS": "1", **extra}


def _gnu_openmp() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=_clean_env(), capture_output=True, text=True,
                           timeout=120)
    return bool(_spin_counts(probe.stderr))


@pytest.fixture(scope="module")
def gnu_openmp():
    if not _gnu_openmp():
        pytest.skip("torch here does not load GNU OpenMP (which prints GOMP_SPINCOUNT)")


@pytest.mark.parametrize("code, local_world, spins", [
    ("import fsdp_speedloader", "2", "0"),  # several ranks: idle threads sleep at once
    ("import fsdp_speedloader", "1", "300000"),  # one: GNU OpenMP's default spin
    ("import torch, fsdp_speedloader", "2", "300000"),  # torch first: too late, and nothing set
])
def test_the_runtime_starts_with_it(gnu_openmp, code, local_world, spins):
    probe = f"{code}; import os; print(os.environ.get('OMP_WAIT_POLICY'))"
    proc = subprocess.run([sys.executable, "-c", probe], env=_clean_env(LOCAL_WORLD_SIZE=local_world),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _spin_counts(proc.stderr) == [spins]
    assert proc.stdout.strip() == ("PASSIVE" if spins == "0" else "None")


def test_torchrun_ranks_start_with_it(gnu_openmp, tmp_path):
    """Two real torchrun ranks that import the package first (as ``-m fsdp_speedloader.app.train`` does): each
    rank's OpenMP starts with no spin; the launcher itself (one process, no ``LOCAL_WORLD_SIZE``) keeps its default."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import fsdp_speedloader, os
        from fsdp_speedloader import openmp_wait
        print("rank", os.environ["LOCAL_RANK"], openmp_wait.chosen, flush=True)
    """))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(_spin_counts(proc.stderr)) == ["0", "0", "300000"]
    assert sorted(re.findall(r"rank \d PASSIVE", proc.stdout)) == ["rank 0 PASSIVE", "rank 1 PASSIVE"]


def test_missed_says_when_torch_came_first(monkeypatch):
    """The trainer warns where the rule applied but torch was loaded first (the package's import chose nothing)."""
    from fsdp_speedloader import openmp_wait

    monkeypatch.setattr(openmp_wait, "chosen", None)
    assert openmp_wait.missed({"LOCAL_WORLD_SIZE": "4"})
    assert not openmp_wait.missed({"LOCAL_WORLD_SIZE": "4", "OMP_WAIT_POLICY": "ACTIVE"})
    assert not openmp_wait.missed({"LOCAL_WORLD_SIZE": "1"})
    monkeypatch.setattr(openmp_wait, "chosen", "PASSIVE")
    assert not openmp_wait.missed({"LOCAL_WORLD_SIZE": "4", "OMP_WAIT_POLICY": "PASSIVE"})
