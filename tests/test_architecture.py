"""The layering holds: imports run one way, local-versus-remote is decided in storage/ only, and
modules stay small enough to read in one sitting. Read from the sources (every import, including
those inside functions), so a violation anywhere fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "dcpkit"
UTILITIES = {"dcpkit", "dcpkit.dist", "dcpkit.failpoints", "dcpkit.layout", "dcpkit.manifest"}
UTILITIES |= {"dcpkit.units", "dcpkit.errors", "dcpkit.safe_pickle", "dcpkit.console"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every dcpkit module ``path`` imports, wherever the import statement stands."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("dcpkit")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dcpkit"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names} & set(MODULES)
    return found


def _names(path: Path) -> set[str]:
    """Identifiers used in code (not in strings or comments)."""
    tree = ast.parse(path.read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        if isinstance(node, ast.ImportFrom):
            names |= {a.name for a in node.names} | {node.module or ""}
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
    return names


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


# (modules, packages they must never import)
FORBIDDEN = [
    ("dcpkit.storage", ("dcpkit.engine", "dcpkit.tools", "dcpkit.convert", "dcpkit.formats")),
    ("dcpkit.formats", ("dcpkit.engine", "dcpkit.tools", "dcpkit.convert", "dcpkit.storage")),
    ("dcpkit.engine", ("dcpkit.tools", "dcpkit.convert", "dcpkit.cli", "dcpkit.train")),
    ("dcpkit.integrity", ("dcpkit.engine", "dcpkit.tools", "dcpkit.convert", "dcpkit.cli")),
    ("dcpkit.convert", ("dcpkit.tools", "dcpkit.cli", "dcpkit.train", "dcpkit.demo")),
    ("dcpkit.tools", ("dcpkit.cli", "dcpkit.train", "dcpkit.demo")),
    ("dcpkit.models", ("dcpkit.engine", "dcpkit.storage", "dcpkit.convert", "dcpkit.tools")),
    ("dcpkit.integrations", ("dcpkit.cli", "dcpkit.train", "dcpkit.demo", "dcpkit.tools")),
]


@pytest.mark.parametrize("layer,forbidden", FORBIDDEN, ids=[f[0] for f in FORBIDDEN])
def test_imports_run_one_way(layer, forbidden):
    bad = []
    for module, path in MODULES.items():
        if not _in(module, layer):
            continue
        bad += [f"{module} imports {imp}" for imp in _imports(path) if _in(imp, *forbidden)]
    assert bad == []


def test_storage_depends_on_utilities_only():
    for module, path in MODULES.items():
        if _in(module, "dcpkit.storage"):
            outside = {i for i in _imports(path) if not _in(i, "dcpkit.storage")} - UTILITIES
            assert outside == set(), module


def test_only_storage_tells_local_from_remote():
    """``is_url`` is defined and called in one module; no module outside storage/ names a
    particular store, fsspec, or the commit marker that only object stores use."""
    users = sorted(m for m, p in MODULES.items() if "is_url" in _names(p))
    assert users == ["dcpkit.storage.opening"]
    store_specific = {"FsspecStore", "LocalStore", "fsspec", "COMMIT_MARKER", "FsspecReader"}
    for module, path in MODULES.items():
        if _in(module, "dcpkit.storage") or module == "dcpkit.layout":
            continue
        assert _names(path) & store_specific == set(), module


def test_modules_stay_small():
    sizes = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    assert sizes["dcpkit.engine.manager"] <= 300  # the facade only: work lives in engine/*
    assert {m: n for m, n in sizes.items() if n > 400} == {}


def test_every_module_imports():
    import importlib

    for module in MODULES:
        if module.endswith("__main__"):
            continue
        if module == "dcpkit.push.vllm_engine":  # vLLM's plugin: imported inside an engine,
            continue  # in the engine's environment (test_push's engines load it there)
        importlib.import_module(module)
