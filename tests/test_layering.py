"""Layering of the cmf packages (docs/ARCHITECTURE.md), checked on the source with ``ast``:

- the imports a module runs, when it is imported or later in a function body (lazily), form no
  cycle, between modules or between the packages directly under ``cmf`` (imports under
  ``if TYPE_CHECKING`` are annotations only and do not count);
- no module imports a private module (``_name``) or a private name of another package, lazily
  or not: what packages share goes through public names (``cmf.numba_prims`` for the numba
  primitives that ``cmf.quant`` and ``cmf.kernels`` both use).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = SRC / "cmf"

# No private cross-package import is allowed (the last ones were made public for issue 27).
ALLOWED_PRIVATE: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _is_package(mod: str) -> bool:
    return MODULES[mod].name == "__init__.py"


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if _is_package(mod) else mod.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(mod: str, node: ast.AST) -> list[tuple[str, str | None]]:
    """(module imported, private name imported from it or None) of one import statement."""
    out: list[tuple[str, str | None]] = []
    if isinstance(node, ast.Import):
        out += [(a.name, None) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        src = _resolve(mod, node)
        for a in node.names:
            sub = f"{src}.{a.name}"
            if sub in MODULES:
                out.append((sub, None))
            else:
                out.append((src, a.name if a.name.startswith("_") and not a.name.startswith("__") else None))
    return [(m, n) for m, n in out if m == "cmf" or m.startswith("cmf.")]


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _executed(nodes):
    """The import statements among ``nodes`` and below them that can run, at import time or
    lazily in a function: all of them but those under ``if TYPE_CHECKING`` (whose ``else``
    branch does run)."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _type_checking(node):
            yield from _executed(node.orelse)
        else:
            yield from _executed(ast.iter_child_nodes(node))


def _trees() -> dict[str, ast.Module]:
    return {m: ast.parse(p.read_text(encoding="utf-8"), str(p)) for m, p in MODULES.items()}


TREES = _trees()


def _parents(mod: str) -> list[str]:
    """``a.b.c`` → ``a.b``, ``a``: importing a module runs its packages' ``__init__`` first."""
    parts = mod.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def _graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod, tree in TREES.items():
        for node in _executed(tree.body):
            for target, _ in _targets(mod, node):
                while target not in MODULES and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in MODULES and target != mod:
                    g[mod].add(target)
                    g[mod].update(p for p in _parents(target) if p != mod and not mod.startswith(p + "."))
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    import sys

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 10000))
    try:
        for v in sorted(g):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(old)
    return out


def _package(mod: str) -> str:
    parts = mod.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else mod


def test_no_import_cycles_between_modules():
    assert _cycles(_graph()) == []


def test_no_import_cycles_between_packages():
    pg: dict[str, set[str]] = {}
    for mod, deps in _graph().items():
        if mod == "cmf":
            continue  # the root package's lazy re-exports sit above everything
        a = _package(mod)
        pg.setdefault(a, set()).update(_package(d) for d in deps if _package(d) not in (a, "cmf"))
    assert _cycles(pg) == []


def _private(mod: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in mod.split("."))


def test_no_private_imports_across_packages():
    bad = []
    for mod, tree in TREES.items():
        for node in ast.walk(tree):  # lazy imports in functions included
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target, name in _targets(mod, node):
                if _package(target) == _package(mod) or target == "cmf":
                    continue
                if (_private(target) or name) and (mod, target) not in ALLOWED_PRIVATE:
                    bad.append(f"{mod}: {target}{'.' + name if name else ''}")
    assert bad == []


def test_quant_does_not_import_kernels():
    """The codecs sit below the kernels: no import of cmf.kernels from cmf.quant, lazy or not."""
    bad = [(mod, t) for mod, tree in TREES.items() if _package(mod) == "cmf.quant"
           for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
           for t, _ in _targets(mod, node) if _package(t) == "cmf.kernels"]
    assert bad == []


def test_format_does_not_import_quant():
    """The container sits below the codecs: cmf.format reaches cmf.quant only through cmf.hooks
    (wired by the package root), never by an import, lazy or not."""
    bad = [(mod, t) for mod, tree in TREES.items() if _package(mod) == "cmf.format"
           for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
           for t, _ in _targets(mod, node) if _package(t) == "cmf.quant"]
    assert bad == []


def test_the_root_wires_the_codecs():
    import sys

    import cmf
    from cmf import hooks

    assert hooks.codec() is sys.modules["cmf.quant"] and cmf.__version__


def test_without_a_codec_the_container_says_which_tensor(tmp_path, monkeypatch):
    """cmf.hooks unwired (as a program that replaced the provider): float tensors still read and
    write; a quantized one is a typed error naming the tensor, not an AttributeError."""
    import numpy as np

    from _builders import header
    from cmf import hooks
    from cmf.format.errors import UnsupportedDtype
    from cmf.format.reader import open as cmf_open
    from cmf.format.writer import CmfWriter

    path = tmp_path / "m.cmf"
    with CmfWriter(path, header()) as w:
        w.add_array("a.f32", np.ones((4, 32), np.float32))
        w.add_array("a.q8", np.ones((4, 32), np.float32), "q8_row")
    monkeypatch.setattr(hooks, "_provider", None)
    monkeypatch.setattr(hooks, "_codec", None)
    with cmf_open(path) as f:
        assert f.array("a.f32").sum() == 128
        with pytest.raises(UnsupportedDtype, match="'a.q8'"):
            f.array("a.q8")
    with pytest.raises(UnsupportedDtype, match="'b'"):
        with CmfWriter(tmp_path / "n.cmf", header()) as w:
            w.add_array("b", np.ones((4, 32), np.float32), "q8_row")


def test_no_lazy_cycles_up_to_the_runtime():
    """In cmf.format, cmf.numba_prims, cmf.quant, cmf.kernels and cmf.runtime not even imports
    inside functions form a cycle between modules (the batched products: each family's body is in
    its module and kernels/gemm.py imports none; runtime/step.py does not import blocks.py)."""
    layers = ("cmf.format", "cmf.numba_prims", "cmf.quant", "cmf.kernels", "cmf.runtime")
    g: dict[str, set[str]] = {}
    for mod, tree in TREES.items():
        if _package(mod) not in layers:
            continue
        deps = g.setdefault(mod, set())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target, _ in _targets(mod, node):
                    while target not in MODULES and "." in target:
                        target = target.rsplit(".", 1)[0]
                    if target in MODULES and target != mod and _package(target) in layers:
                        deps.add(target)
    assert _cycles(g) == []


def test_numba_prims_is_a_bottom_module():
    """cmf.numba_prims imports nothing from cmf (both quant and kernels build on it) but
    cmf.numba_cache, which imports nothing from cmf at all."""
    for mod, allowed in (("cmf.numba_prims", ["cmf.numba_cache"]), ("cmf.numba_cache", [])):
        tree = TREES[mod]
        assert [t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for t, _ in _targets(mod, node)] == allowed, mod


@pytest.mark.parametrize("case", ["relative", "private-name"])
def test_the_checks_see_what_they_look_for(case):
    """The analysis itself: a relative import resolves, a private name is reported."""
    code = "from ..quant import _fast" if case == "relative" else "from ..quant.float import _f16_table"
    node = ast.parse(code).body[0]
    got = _targets("cmf.kernels.gemm", node)
    if case == "relative":
        assert got == [("cmf.quant._fast", None)] and _private(got[0][0])
    else:
        assert got == [("cmf.quant.float", "_f16_table")]
