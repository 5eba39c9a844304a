"""The command line of the Hydra entry points: overrides checked before Hydra runs, and ``--help``.

:func:`check_overrides` reads the overrides as Hydra parses them and refuses, in the project's one line (a
``ValueError``; ``launch`` prints it and exits 2), a group option that does not exist (``model=lama2_7b``), a
group the entry point does not have (``experiment=...`` for generate) and a key that is not in the composed config
(``schedule.num_sub_bachtes=4``), each with the closest valid names. Hydra would answer these with its own
exit-1 text. Everything else is left to Hydra: the check composes with the same repository and the same defaults
lists, so it only speaks where Hydra would fail. ``+key=value`` adds a key: the entry point's dataclass then
refuses an unknown one (``validation.dataclass_from_dict``, with the same suggestions).

``--help`` is Hydra's, with each entry point's own template (``conf/hydra/help/<entry>.yaml``); its groups and
their options come from the resolver registered here, ``${fsdp_speedloader.help_groups:${hydra.runtime.choices}}``:
the groups of that entry point's defaults list (not every group in ``conf/``), read from Hydra's repository.
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from fsdp_speedloader.validation import closest_names, did_you_mean, suggestion


def config_path() -> str:
    """Where the entry points' configs are. Installed: the package fsdp_speedloader.conf; from a source checkout
    that is not installed, the conf/ directory next to the package."""
    if importlib.util.find_spec("fsdp_speedloader.conf") is not None:
        return "pkg://fsdp_speedloader.conf"
    return str(Path(__file__).resolve().parents[2] / "conf")


HELP_GROUPS_RESOLVER = "fsdp_speedloader.help_groups"


def _is_hydra_key(key: str) -> bool:
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def _parse_command_line(argv: Sequence[str]) -> Optional[Any]:
    """Hydra's own parse of ``argv`` (flags and overrides), or None where Hydra will report the problem itself."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    try:
        args, unknown = parser.parse_known_args(list(argv))
    except SystemExit:  # argparse's usage error: Hydra prints the same
        return None
    return None if unknown else args


def check_command_line(config_name: str, argv: Sequence[str]) -> None:
    """:func:`check_overrides` on the overrides of a Hydra command line (``sys.argv[1:]``) for the primary config
    ``config_name`` (``--config-name`` wins); nothing for ``--config-path``/``--config-dir`` (another search
    path) or shell completion."""
    from hydra.core.global_hydra import GlobalHydra

    args = _parse_command_line(argv)
    if args is None or args.config_path or args.config_dir or args.shell_completion or not args.overrides:
        return
    if GlobalHydra.instance().is_initialized():  # inside a compose API context: the caller's configs, not ours
        return
    check_overrides(args.config_name or config_name, args.overrides)


def _initialize():
    """Hydra's compose API on the configs the entry points use (:func:`config_path`)."""
    from hydra import initialize_config_dir, initialize_config_module


    path = config_path()
    if path.startswith("pkg://"):
        return initialize_config_module(path[len("pkg://"):], version_base="1.3")
    return initialize_config_dir(config_dir=path, version_base="1.3")


def _group_options(loader: Any, group: str) -> list[str]:
    from hydra.core.object_type import ObjectType

    return sorted(loader.get_group_options(group, ObjectType.CONFIG))


def _is_group(loader: Any, key: str) -> bool:
    parent, _, leaf = key.rpartition("/")
    return "." not in key and leaf in loader.list_groups(parent)


def check_overrides(config_name: str, overrides: Sequence[str]) -> None:
    """``ValueError`` (one line, with the closest valid names) for the first override naming a group option, a
    group or a key that the primary config ``config_name`` does not have; nothing where Hydra would compose.

    ``hydra.*`` / ``hydra/...`` overrides, deletions (``~``) and additions of keys (``+key``, ``++key``) are not
    checked. A sweep (``model=a,b``) has each of its options checked.
    """
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:  # a syntax error: Hydra's message points at it
        return
    with _initialize():
        loader = GlobalHydra.instance().config_loader()
        try:
            choices = compose(config_name, return_hydra_config=True).hydra.runtime.choices
        except HydraException:  # conf/ itself does not compose: not a typo on the command line
            return
        groups = sorted(g for g in choices if not _is_hydra_key(g))
        composed_with, keys = [], []
        for override in parsed:
            key = override.key_or_group
            if _is_hydra_key(key) or override.is_delete() or override.package is not None:
                continue
            if _is_group(loader, key):
                raw = None if override.is_sweep_override() else override.value()
                if raw is not None and not isinstance(raw, (str, list)):  # Hydra: a traceback ("Got float")
                    raise ValueError(f"{key}={raw}: {key} is a config group: name one of its options "
                                     f"({', '.join(_group_options(loader, key))}), or set a key under it "
                                     f"({key}.KEY=VALUE)")
                values = _group_values(override)
                _check_group(loader, config_name, key, values, groups, adds=override.is_add())
                if values:
                    composed_with.append(f"{'+' if override.is_add() else ''}{key}={values[0]}")
            elif not (override.is_add() or override.is_force_add()):
                keys.append((key, None if override.is_sweep_override() else override.value()))
        if not keys:
            return
        try:
            cfg = compose(config_name, overrides=composed_with)
        except HydraException:
            return
    for key, value in keys:
        _check_key(cfg, key, groups, value)
    _check_model_path_shapes(cfg, keys)


# What a model.path run still takes from the model group: its label and the attention kernel; every other model key
# describes the shapes of a fresh model, which model.path's config.json replaces.
MODEL_PATH_KEYS = ("model.path", "model.name", "model.attn_implementation")


def _check_model_path_shapes(cfg: DictConfig, keys: Sequence[tuple[str, Any]]) -> None:
    """``ValueError`` for an override of a model shape (``model.num_layers=1``) where ``model.path`` names a
    checkpoint: its config.json gives the shapes, and the override would be dropped without a word."""
    given = dict(keys)  # a sweep's value is None here, as is null: neither names one checkpoint
    path = given["model.path"] if "model.path" in given else OmegaConf.select(cfg, "model.path", default=None)
    if not path:
        return
    for key, _ in keys:
        if key.startswith("model.") and key not in MODEL_PATH_KEYS:
            raise ValueError(f"{key}: model.path={path!r} takes the model's shapes and settings from its config.json, "
                             f"so {key} would be ignored; drop it (with model.path the model group gives only "
                             f"{', '.join(k for k in MODEL_PATH_KEYS if k != 'model.path')}); to change the model "
                             "itself, edit a copy of its config.json")


def _group_values(override: Any) -> list[str]:
    """The options an override of a group names (each of a sweep's); [] where it names none or not by name."""
    if override.is_sweep_override():
        if not override.is_discrete_sweep():
            return []
        return list(override.sweep_string_iterator())
    value = override.value()
    return [value] if isinstance(value, str) else []


def _check_group(loader: Any, config_name: str, group: str, values: Iterable[str], groups: Sequence[str], *,
                 adds: bool) -> None:
    if not adds and group not in groups:  # Hydra: "Could not override 'experiment'. No match in the defaults list."
        have = ", ".join(groups) if groups else "none"
        raise ValueError(f"{group}: conf/{config_name}.yaml has no config group {group} (its groups: {have})")
    options = _group_options(loader, group)
    for value in values:
        if value not in options and value != "null":
            raise ValueError(f"unknown {group}={value}{did_you_mean(value, options)} (options: {', '.join(options)})")


def _check_key(cfg: DictConfig, key: str, groups: Sequence[str], value: Any = None) -> None:
    """``ValueError`` when ``key`` is not in ``cfg``: the closest names under its deepest existing parent, else
    keys anywhere whose last part is close to its last part (``num_sub_batches`` -> ``schedule.num_sub_batches``);
    or when ``key`` is a section of keys given a plain ``value`` (Hydra: "Cannot merge DictConfig with ...")."""
    parts = key.split(".")
    node: Any = cfg
    for depth, part in enumerate(parts):
        if not isinstance(node, DictConfig):  # a list or a value (null) on the way: Hydra's own message
            return
        names = {str(k) for k in node.keys()}  # `in` would say no for a mandatory `???` value
        if part in names:
            node = node._get_node(part)
            continue
        parent = ".".join(parts[:depth])
        rest = ".".join(parts[depth + 1:])
        siblings = sorted(names | ({g for g in groups if "/" not in g} if depth == 0 else set()))
        near = [".".join(p for p in (parent, name, rest) if p) for name in closest_names(part, siblings)]
        if not near:
            by_leaf: dict[str, list[str]] = {}
            for path in _paths(cfg):
                by_leaf.setdefault(path.rsplit(".", 1)[-1], []).append(path)
            near = [path for leaf in closest_names(parts[-1], by_leaf, cutoff=0.75) for path in by_leaf[leaf]][:3]
        if near:
            raise ValueError(f"unknown key {key}{suggestion(near)}")
        under = f" under {parent}" if parent else ""
        raise ValueError(f"unknown key {key} (the keys{under}: {', '.join(siblings)})")
    if isinstance(node, DictConfig) and value is not None and not isinstance(value, dict):
        names = [f"{key}.{k}" for k in node.keys()]
        raise ValueError(f"{key} is a section, not a value: set one of its keys ({', '.join(names)}), "
                         f"e.g. {names[0]}=...")


def _paths(cfg: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a composed config, nodes and leaves (without resolving interpolations)."""
    out = []
    if isinstance(cfg, DictConfig):
        for key in cfg.keys():
            path = f"{prefix}{key}"
            out.append(path)
            out += _paths(cfg._get_node(key), f"{path}.")
    return out


def help_groups(choices: Any) -> str:
    """The lines of ``--help`` that list an entry point's groups: each with its current option and every option
    in the repository (Hydra's, when the help is shown; the choices alone otherwise)."""
    from hydra.core.global_hydra import GlobalHydra

    chosen = {str(g): choices[g] for g in choices if not _is_hydra_key(str(g))}
    if not chosen:
        return "  (none: every setting is a key=value)"
    loader = GlobalHydra.instance().config_loader() if GlobalHydra.instance().is_initialized() else None
    current = {group: f"{group}={'null' if option is None else option}" for group, option in chosen.items()}
    width = max(len(text) for text in current.values()) + 2
    lines = []
    for group in sorted(chosen):
        options = _group_options(loader, group) if loader is not None else []
        line = f"{current[group]:<{width}}" + (f"options: {', '.join(options)}" if options else "")
        lines.append(textwrap.fill(line, width=110, initial_indent="  ", subsequent_indent=" " * (width + 11),
                                   break_on_hyphens=False))
    return "\n".join(lines)


OmegaConf.register_new_resolver(HELP_GROUPS_RESOLVER, help_groups, replace=True)
