"""The import structure of qerl: no circular imports, the FP4 kernels below their dispatcher, no oversized module.

Read with `ast` (nothing is imported). Two graphs: the imports that run when a module is imported (everything
outside function bodies, try/except and if blocks included), which must have no cycle at all, as a cycle there
fails or deadlocks on half-initialised modules; and all imports, those inside functions included, since a lazy
import is still a dependency and a circle through one (the FP4 dispatcher and its kernels importing each other)
is what this file exists to catch. The second allows LAZY_FACTORY_EDGES, a factory that picks a class by name.
`from pkg import name` is an edge to pkg.name when that is a module, else to pkg; a package's own __init__ is not
an edge of its submodules.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "qerl"
MAX_LINES = 450
KNOWN_OVERSIZED: dict[str, int] = {}  # path -> lines: a module waiting to be split, which must not grow meanwhile
KERNELS = "qerl.quant.kernels"
# leaves: qerl.errors (the one-line QerlError), qerl.io (atomic writes; the standard library only)
KERNELS_MAY_IMPORT = ("qerl.quant.kernels", "qerl.errors", "qerl.io")
LEAVES = ("qerl.errors", "qerl.io")
# none left: make_engine lives in qerl.rollout (the package), above the engines, not in the contract they import
LAZY_FACTORY_EDGES: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _targets(node: ast.AST, module: str, is_package: bool, known) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in known]
    base = node.module or ""
    if node.level:  # relative: from the package of this module
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
    out = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    return [name for name in out if name in known]


def _imports(path: Path, module: str, known, in_functions: bool) -> set[str]:
    """qerl modules that `module` imports at import time (and inside functions when in_functions)."""
    found = set()

    def visit(node, in_function):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and (in_functions or not in_function):
            found.update(_targets(node, module, path.name == "__init__.py", known))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), False)
    found.discard(module)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_no_circular_imports():
    modules = _modules()
    graph = {m: _imports(p, m, modules, in_functions=False) for m, p in modules.items()}
    assert _cycle(graph) is None, f"circular import: {' -> '.join(_cycle(graph))}"


def test_no_circular_dependencies_through_lazy_imports():
    modules = _modules()
    graph = {m: {t for t in _imports(p, m, modules, in_functions=True) if (m, t) not in LAZY_FACTORY_EDGES}
             for m, p in modules.items()}
    assert _cycle(graph) is None, f"circular dependency: {' -> '.join(_cycle(graph))}"


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_kernels_import_nothing_above_them():
    modules = _modules()
    for module, path in modules.items():
        if module == KERNELS or module.startswith(KERNELS + "."):
            above = {t for t in _imports(path, module, modules, in_functions=True)
                     if not any(t == ok or t.startswith(ok + ".") for ok in KERNELS_MAY_IMPORT)}
            assert not above, f"{module} imports {sorted(above)} (above qerl.quant.kernels)"


def test_the_leaves_the_kernels_may_import_import_no_qerl_module():
    """What the kernels may import besides themselves stays a leaf, so the kernels stay below everything else."""
    modules = _modules()
    for leaf in LEAVES:
        found = _imports(modules[leaf], leaf, modules, in_functions=True)
        assert not found, f"{leaf} imports {sorted(found)}: the kernels may import it only while it is a leaf"


def test_one_dispatcher_calls_the_kernels():
    """Outside qerl.quant.kernels only the dispatcher (and qerl.rollout's own Triton attention kernels, static and
    paged, and the split-K scaffolding they share, which use the launch helpers) imports kernel modules that launch
    FP4 matmuls."""
    modules = _modules()
    launchers = {f"{KERNELS}.{name}" for name in ("triton_fp4", "triton_dequant", "cuda_fp4")}
    allowed = {"qerl.quant.dispatch", "qerl.rollout.triton_attention", "qerl.rollout.triton_paged",
               "qerl.rollout.triton_split"}
    users = {m for m, p in modules.items() if not m.startswith(KERNELS)
             and launchers & _imports(p, m, modules, in_functions=True)}
    assert users <= allowed, f"kernels imported outside the dispatcher: {sorted(users - allowed)}"


def test_no_module_is_oversized():
    """Over MAX_LINES only the modules of KNOWN_OVERSIZED, each no longer than listed (lower the entry, or drop
    it, as such a module is split)."""
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    grown = {path: n for path, n in long.items() if n > KNOWN_OVERSIZED.get(path, MAX_LINES)}
    assert not grown, f"modules over {MAX_LINES} lines (split them by concept): {grown}"
    assert set(KNOWN_OVERSIZED) <= set(long), f"no longer oversized, drop from KNOWN_OVERSIZED: " \
        f"{sorted(set(KNOWN_OVERSIZED) - set(long))}"
