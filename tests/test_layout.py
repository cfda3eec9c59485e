"""The package layout: no import circles, and only the command layer reaches the training code.

Imports are read from the source with ``ast`` (every ``import``, also those inside functions),
so a circle that only lazy imports keep from failing at run time is still found. Importing
``a.b.c`` runs the ``__init__`` of ``a`` and ``a.b`` too, so those count as imported as well,
except the packages that contain the importing module (already initialised by then).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("alibi_vit", "kernels", "lit_modules", "datamodules")
# Only this part of alibi_vit may import the training layer (LightningModules and DataModules).
COMMAND_LAYER = "alibi_vit.cli"
TRAINING_LAYER = ("lit_modules", "datamodules")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_names(module: str, path: Path, known: set[str]) -> set[str]:
    """Every project module that importing ``module`` may import (directly, lazily or via a package ``__init__``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, path.name == "__init__.py", node)
            targets.add(source)
            targets.update(f"{source}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    own_packages = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    if path.name == "__init__.py":
        own_packages.add(module)
    edges = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name in known and name not in own_packages and name != module:
                edges.add(name)
    return edges


def missing_imports(module: str, path: Path, known: set[str]) -> list[str]:
    """Imports of a project module that does not exist (``from pkg import name`` may name an attribute)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [_resolve(module, path.name == "__init__.py", node)]
        else:
            continue
        missing += [f"{module} imports {name}" for name in names
                    if name.split(".")[0] in PACKAGES and name not in known]
    return missing


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_names(name, path, set(modules)) for name, path in modules.items()}


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_graph_sees_lazy_and_package_imports():
    graph = import_graph()
    # `from ..analysis.probe import ...` inside a function is an import of the module and of its package
    assert {"alibi_vit.analysis", "alibi_vit.analysis.probe"} <= graph["alibi_vit.cli.probe"]
    # the package root registers the models with timm
    assert "alibi_vit.models.registry" in graph["alibi_vit"]


def test_circle_finder_finds_a_circle():
    assert find_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_circles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_every_project_import_exists():
    """Also in the benchmark scripts and the tests, which import the packages from outside."""
    modules = project_modules()
    scripts = {_module_name(p): p for folder in ("benchmarks", "tests") for p in sorted((ROOT / folder).glob("*.py"))}
    missing = [m for name, path in {**modules, **scripts}.items() for m in missing_imports(name, path, set(modules))]
    assert not missing, "; ".join(missing)


def test_no_import_circles():
    circles = find_circles(import_graph())
    assert not circles, "import circles: " + "; ".join(" ↔ ".join(c) for c in circles)


def test_only_the_command_layer_imports_training_code():
    offenders = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module.startswith("alibi_vit") and not (module == COMMAND_LAYER or module.startswith(COMMAND_LAYER + "."))
        for target in targets if target.split(".")[0] in TRAINING_LAYER)
    assert not offenders, "; ".join(offenders)


def test_library_layers_import_downwards_only():
    """models ← analysis, trainable ← app ← cli: a model never imports an evaluation, a command or the
    trainable code; the app (a server) builds on the trainable code and is started by a command."""
    lower = {"alibi_vit.models": ("alibi_vit.analysis", "alibi_vit.trainable", "alibi_vit.app", "alibi_vit.cli"),
             "alibi_vit.analysis": ("alibi_vit.trainable", "alibi_vit.app", "alibi_vit.cli"),
             "alibi_vit.trainable": ("alibi_vit.analysis", "alibi_vit.app", "alibi_vit.cli"),
             "alibi_vit.app": ("alibi_vit.analysis", "alibi_vit.cli"),
             "alibi_vit.measure": ("alibi_vit.models", "alibi_vit.analysis", "alibi_vit.trainable", "alibi_vit.app",
                                   "alibi_vit.cli")}
    offenders = sorted(f"{module} imports {target}" for module, targets in import_graph().items()
                       for package, above in lower.items() if module.startswith(package)
                       for target in targets if target.startswith(above))
    assert not offenders, "; ".join(offenders)


def _resolve_dotted(name: str):
    """The object a dotted name such as ``alibi_vit.analysis.probe.positional_r2`` stands for."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:i]))
    return obj


def test_every_name_the_readme_and_docs_show_imports():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n".join(page.read_text() for page in pages)
    names = sorted(set(re.findall(r"\balibi_vit(?:\.[A-Za-z_]\w*)+", text)))
    assert "alibi_vit.create_backbone" in names and "alibi_vit.patch_features" in names
    broken = []
    for name in names:
        try:
            _resolve_dotted(name)
        except (ImportError, AttributeError) as err:
            broken.append(f"{name} ({err})")
    assert not broken, "; ".join(broken)
