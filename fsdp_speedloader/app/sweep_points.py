"""The points of a Hydra sweep: the swept keys and values of a command line and a config's ``hydra.sweeper.params``,
and their cartesian product in Hydra's basic sweeper's order. Read by the sweep driver (``app.sweep``, which runs
them) and by the report (``app.sweep_report``, which finds the points a stopped Hydra multirun never ran)."""

from __future__ import annotations

import itertools
from typing import Sequence


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], dict[str, list[str]]]:
    """(fixed overrides, {swept key: its values}) of a command line, parsed as Hydra parses it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    fixed, swept = [], {}
    for text, parsed in zip(overrides, OverridesParser.create().parse_overrides(list(overrides))):
        if parsed.is_sweep_override():
            swept[parsed.get_key_element()] = list(parsed.sweep_string_iterator())
        else:
            fixed.append(text)
    return fixed, swept


def sweep_axes(config_params: dict, cli_swept: dict[str, list[str]],
               cli_fixed: Sequence[str] = ()) -> dict[str, list[str]]:
    """The swept keys and values: ``hydra.sweeper.params`` of the config, then the command line's.

    The command line wins, as in Hydra: a key given one value there (``cli_fixed``) is not swept.
    """
    _, axes = split_overrides([f"{k}={v}" for k, v in config_params.items()])
    for key in {o.split("=", 1)[0].lstrip("+~") for o in cli_fixed}:
        axes.pop(key, None)
    for key, values in cli_swept.items():
        axes.pop(key, None)  # the command line wins, and goes last (varies fastest), as in Hydra
        axes[key] = values
    return axes


def expand_points(axes: dict[str, list[str]]) -> list[dict[str, str]]:
    """The cartesian product of the axes, the last key varying fastest (Hydra's basic sweeper order)."""
    keys = list(axes)
    return [dict(zip(keys, values)) for values in itertools.product(*(axes[k] for k in keys))]
