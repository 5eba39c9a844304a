"""Checks shared by every options dataclass: each raises ``ValueError`` naming the field and what to change,
so a bad value fails before any model or memory is allocated."""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from typing import Any, Iterable, Sequence


def check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def check_choice(value: Any, name: str, choices: tuple) -> None:
    check(value in choices, name, f"got {value!r}; choose one of {', '.join(map(repr, choices))}")


# One dtype, two spellings: torch's names (param_dtype=bfloat16) and the short ones (optim.state_dtype=bf16).
DTYPE_SPELLINGS = (("float32", "fp32"), ("bfloat16", "bf16"), ("float16", "fp16"))


def dtype_choice(value: Any, name: str, choices: tuple) -> Any:
    """``value`` in the spelling ``choices`` use, so that either spelling works for every dtype key
    ('bf16' for param_dtype, 'bfloat16' for optim.state_dtype); else ``check_choice``'s error."""
    for spellings in DTYPE_SPELLINGS:
        if value in spellings:
            value = next((s for s in spellings if s in choices), value)
    check_choice(value, name, choices)
    return value


def check_positive(value: Any, name: str, *, allow_zero: bool = False) -> None:
    bound = "must be >= 0" if allow_zero else "must be >= 1"
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= (0 if allow_zero else 1)
    check(ok, name, f"got {value!r}; {bound} (an integer)")


def suggestion(names: Sequence[str]) -> str:
    """': did you mean a?' (': did you mean a, b or c?'); '' for no names."""
    if not names:
        return ""
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return f": did you mean {listed}?"


def closest_names(name: str, candidates: Iterable[str], *, cutoff: float = 0.6) -> list[str]:
    """The ``candidates`` closest to ``name`` (difflib's ratio, at least ``cutoff``): the best, and at most two
    others nearly as close (``lama2_7b`` -> ``llama2_7b`` alone, not ``llama2_70b`` too)."""
    scored = sorted(((difflib.SequenceMatcher(None, name, c).ratio(), c) for c in set(candidates)), reverse=True)
    scored = [(score, c) for score, c in scored if score >= cutoff]
    return [c for score, c in scored[:3] if score >= scored[0][0] - 0.05]


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """:func:`suggestion` with :func:`closest_names`; '' when no candidate is close."""
    return suggestion(closest_names(name, candidates))



def coerce(value: Any, annotation: Any, name: str) -> Any:
    """Checks a YAML/CLI value against the field's type (ints are accepted where floats are)."""
    optional = typing.get_origin(annotation) is typing.Union and type(None) in typing.get_args(annotation)
    if optional:
        if value is None:
            return None
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    base = typing.get_origin(annotation) or annotation
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base in (int, float) and isinstance(value, bool) or not isinstance(value, base):
        raise ValueError(f"{name}: expected {getattr(base, '__name__', base)}, got {value!r}")
    return value


def dataclass_from_dict(cls: type, d: Any, prefix: str = "") -> Any:
    """A validated ``cls`` from a plain nested dict (e.g. ``OmegaConf.to_container``): unknown keys and
    wrong types are refused with the dotted key; a field whose default is a dataclass is read recursively."""
    if not isinstance(d, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        def refuse(key: str) -> str:  # the closest field names, matched without the shared prefix
            near = closest_names(key, fields)
            return f"unknown key {prefix}{key}" + (suggestion([prefix + name for name in near]) or
                                                   f" (valid keys: {', '.join(prefix + n for n in sorted(fields))})")

        raise ValueError("; ".join(refuse(key) for key in unknown))
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in d.items():
        factory = fields[name].default_factory
        nested = factory if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory) else None
        kwargs[name] = (dataclass_from_dict(nested, value, f"{prefix}{name}.") if nested
                        else expand_home(name, coerce(value, hints[name], f"{prefix}{name}")))
    return cls(**kwargs)


# Keys that name a file or directory: '~' there is the home directory, as in a shell (Hydra passes it through).
PATH_KEYS = frozenset({"path", "val_path", "tokenizer", "dir", "resume", "checkpoint_path", "out", "mixture"})


def expand_home(name: str, value: Any) -> Any:
    """``value`` of key ``name`` with a leading '~' expanded where the key names a path (a mixture's entries'
    paths too); anything else as it is."""
    if name not in PATH_KEYS:
        return value
    if isinstance(value, str) and value.startswith("~"):
        return os.path.expanduser(value)
    if isinstance(value, list):  # data.mixture: [{path, weight}, ...]
        return [{**e, "path": expand_home("path", e["path"])} if isinstance(e, dict) and "path" in e else e
                for e in value]
    return value
