"""The house rules: llmsim's modules sit on floors (inputs < model < sim < measure < app), a module imports only
its own floor or lower ones, and no chain of imports -- at module level or inside a function -- comes back to
where it started. Read from the source with ast, so nothing is imported to check it."""
import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "llmsim"
# the floors, lowest first; `errors` and `enums` are the vocabulary every floor shares, the package itself
# (`llmsim.predict`, the lazy names) the face above them all
FLOORS = {"llmsim.errors": 0, "llmsim.enums": 0, "llmsim.inputs": 1, "llmsim.model": 2, "llmsim.sim": 3,
          "llmsim.measure": 4, "llmsim.app": 5, "llmsim": 6}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _compiled() -> set[str]:  # C extensions, by the name their source gives them
    return {".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts) for path in PACKAGE.rglob("*.c")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "llmsim"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "llmsim":
                continue
            # `from llmsim.sim import allocator` imports the module, `from llmsim.errors import X` the module
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return found - {name}


def _floor(name: str) -> int:
    return FLOORS[max((prefix for prefix in FLOORS if name == prefix or name.startswith(prefix + ".")), key=len)]


def _graph() -> nx.DiGraph:
    modules = _modules()
    known = set(modules) | _compiled()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for target in _imports(name, path, known):
            assert target in known, f"{name} imports {target}, which is not a module of llmsim"
            graph.add_edge(name, target)
    return graph


def test_every_module_sits_on_a_floor():
    assert all(_floor(name) is not None for name in _modules())
    assert {path.parent.name for path in PACKAGE.rglob("*.py")} >= {"inputs", "model", "sim", "measure", "app"}


def test_no_module_imports_a_higher_floor():
    upward = [f"{a} (floor {_floor(a)}) imports {b} (floor {_floor(b)})" for a, b in _graph().edges
              if _floor(b) > _floor(a)]
    assert not upward, "\n".join(upward)


def test_there_is_no_import_cycle():
    cycles = list(nx.simple_cycles(_graph()))
    assert not cycles, "\n".join(" -> ".join(cycle + cycle[:1]) for cycle in cycles)


def test_packages_import_nothing_when_they_load():
    # importing llmsim.sim.allocator runs llmsim/__init__.py and llmsim/sim/__init__.py first: they must stay empty
    # of imports (the package face imports lazily, inside its functions), or every floor would pull in the top one
    for floor in ("", "inputs", "model", "sim", "measure", "app"):
        path = PACKAGE / floor / "__init__.py"
        tree = ast.parse(path.read_text())
        eager = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
                 and any((getattr(node, "module", None) or alias.name).startswith("llmsim") for alias in node.names)]
        assert not eager, f"{path.relative_to(PACKAGE.parent)} imports llmsim modules when it loads"


def test_the_checker_sees_function_level_imports(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from llmsim.app.cli import main\n")
    assert _imports("llmsim.sim.probe", path, set(_modules())) == {"llmsim.app.cli"}
