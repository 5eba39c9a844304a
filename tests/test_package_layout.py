"""The package's layers, read from its source (ast, nothing imported): no import cycles, no module importing
another module's private name, no library module importing ``app/``, Hydra, OmegaConf or W&B, and only the
seam (``fsdp2/``) importing FSDP2's private modules or touching its private attributes."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_speedloader"
APP = "fsdp_speedloader.app"
SEAM = "fsdp_speedloader.fsdp2"
APPLICATION_LIBRARIES = ("hydra", "omegaconf", "wandb")
FSDP2_PRIVATE_ATTRIBUTES = re.compile(r"\._(sharded_param_data|fsdp_param_groups?|get_fsdp_state)\b|reset_sharded_param|"
                                      r"swap_tensors")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in the file, at any depth (function-level imports count too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


def _edges() -> dict[str, set[str]]:
    edges = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for target, names in _imports(path):
            if not target.startswith("fsdp_speedloader"):
                continue
            for name in names or [""]:
                full = f"{target}.{name}"
                edges[module].add(full if full in MODULES else target)
    return edges


def test_the_package_has_no_import_cycles():
    edges, index, low, stack, on_stack, cycles = _edges(), {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in MODULES:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in MODULES:
        if module not in index:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


def test_no_module_imports_another_module_s_private_name():
    offenders = [f"{module}: {target}.{name}" for module, path in MODULES.items()
                 for target, names in _imports(path) if target.startswith("fsdp_speedloader")
                 for name in names if name.startswith("_") and name != "__version__"]
    assert not offenders, offenders


def test_the_library_imports_no_application_layer():
    offenders = [f"{module}: {target}" for module, path in MODULES.items() if not module.startswith(APP)
                 for target, _ in _imports(path)
                 if target.startswith(APP) or target.split(".")[0] in APPLICATION_LIBRARIES]
    assert not offenders, offenders


def test_only_the_seam_reaches_into_fsdp2_private_state():
    imports = [f"{module}: {target}" for module, path in MODULES.items() if not module.startswith(SEAM)
               for target, _ in _imports(path) if target.startswith("torch.distributed.fsdp._")]
    attributes = [f"{module}: {m.group(0)}" for module, path in MODULES.items() if not module.startswith(SEAM)
                  for m in FSDP2_PRIVATE_ATTRIBUTES.finditer(path.read_text())]
    assert not imports and not attributes, imports + attributes


def test_the_checks_see_the_whole_package():
    """The checks above cannot pass by reading nothing: the layers they police exist."""
    assert {"fsdp_speedloader.engine.speedloader", "fsdp_speedloader.fsdp2.contract", "fsdp_speedloader.app.trainer",
            "fsdp_speedloader.options"} <= set(MODULES)
    assert any(target.startswith("torch.distributed.fsdp._") for path in (PACKAGE / "fsdp2").glob("*.py")
               for target, _ in _imports(path)) or "private_module" in (PACKAGE / "fsdp2" / "contract.py").read_text()
