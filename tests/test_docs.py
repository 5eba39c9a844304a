"""The docs a new user follows, checked against the code: every model option is listed in docs/configuration.md,
and docs/quickstart.md's commands run as written, writing only under the temporary directory they start in."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch_utils import REPO, clean_env, tail

QUICKSTART = REPO / "docs" / "quickstart.md"


def test_configuration_md_lists_every_model_option():
    row = next(line for line in (REPO / "docs" / "configuration.md").read_text().splitlines()
               if line.startswith("| `model` |"))
    listed = set(re.findall(r"`([^`]+)`", row.split("|")[2]))
    assert listed == {p.stem for p in (REPO / "conf" / "model").glob("*.yaml")}


def _quickstart_commands() -> str:
    """The first bash block of docs/quickstart.md: the commands a new user pastes."""
    return re.search(r"```bash\n(.*?)```", QUICKSTART.read_text(), re.S).group(1)


@pytest.mark.slow
def test_quickstart_runs_as_written_and_writes_only_under_its_temporary_directory(tmp_path):
    """train -> generate -> export -> transformers, pasted into bash; TMPDIR points mktemp into tmp_path. The export
    in the same directory again is refused naming overwrite=true, and goes through with it."""
    start, temp = tmp_path / "cwd", tmp_path / "tmp"
    start.mkdir()
    temp.mkdir()
    env = clean_env(tmp_path, TMPDIR=str(temp), PATH=f"{Path(sys.executable).parent}:{clean_env(tmp_path)['PATH']}")
    script = "set -euo pipefail\n" + _quickstart_commands() + '\necho "QUICKSTART_DIR=$PWD"\n'
    proc = subprocess.run(["bash", "-c", script], cwd=start, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, tail(out)
    assert "Traceback" not in out and "FutureWarning" not in out, tail(out)
    assert list(start.iterdir()) == []  # nothing in the directory it was pasted in
    run_dir = Path(re.search(r"QUICKSTART_DIR=(.*)", proc.stdout).group(1))
    assert run_dir.parent == temp

    # generate printed the first prompts with their completions; transformers' greedy tokens on the export are ours
    records = [json.loads(line) for line in next(run_dir.glob("outputs/generate/*/*/generations.jsonl")).read_text()
               .splitlines()]
    shown = [f"[{r['index']}] {r['prompt']!r} -> {r['completion']!r}" for r in records[:3]]
    assert all(line in out for line in shown), tail(out)
    assert "eos_token_id: 256" in proc.stdout
    once = next(r for r in records if r["prompt"] == "Once upon a time")
    assert repr(once["completion"]) in proc.stdout.splitlines(), tail(out)
    assert json.loads((run_dir / "tiny_hf" / "config.json").read_text())["eos_token_id"] == 256

    export = next(line for line in _quickstart_commands().splitlines() if "app.export" in line).split("#")[0]
    again = subprocess.run(["bash", "-c", export], cwd=run_dir, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert again.stderr.strip().splitlines()[-1].startswith("error: out: tiny_hf is not empty")
    assert "overwrite=true" in again.stderr
    again = subprocess.run(["bash", "-c", export + " overwrite=true"], cwd=run_dir, env=env, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, tail(again.stderr)
