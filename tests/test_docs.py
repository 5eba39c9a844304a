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
