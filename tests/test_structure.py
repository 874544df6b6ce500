"""The house's shape: common.py imports no module of the project, the trainers' machinery (training.py) is imported
by the two trainers alone, credit.py (a diagnostic stage) by no stage, colbench.py (the benchmark's rules) imports no
sandbox, and the project's imports form no cycle. Read from the source (the import statements), not by running it."""
import ast

from conftest import ROOT

MODULES = {p.stem: p for p in ROOT.glob("*.py")}


def imports(name):
    """The project modules a module imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(MODULES) - {name}


def test_the_toolbox_and_the_diagnostics_stand_apart():
    graph = {name: imports(name) for name in MODULES}
    assert graph["common"] == set()
    assert {name for name, deps in graph.items() if "training" in deps} == {"train_critic", "train_dpo"}
    assert {name for name, deps in graph.items() if "credit" in deps} == set()
    assert "sandbox" not in graph["colbench"]

    def cycle_from(name, path):
        for dep in graph[name]:
            if dep in path:
                return path[path.index(dep):] + [dep]
            if found := cycle_from(dep, path + [dep]):
                return found
        return None
    assert all(cycle_from(name, [name]) is None for name in graph), [cycle_from(n, [n]) for n in graph]
