"""The house's shape: at the top the stages and common.py, which imports nothing of the project; two packages,
colbench/ (the benchmark, which needs nothing of the loop) and machinery/ (models, samplers, FSDP2), whose
training module only the two trainers import; credit.py (a diagnostic stage) imported by no stage; colbench's rules
(its __init__) run no code, so import no sandbox; no import cycle. Read from the source (the import statements),
not by running it."""
import ast

from conftest import ROOT

STAGES = {"generate_tasks", "rollout", "train_critic", "label_turns", "train_dpo", "evaluate"}
TOP = STAGES | {"common", "credit", "view", "simulator"}
PACKAGES = {"colbench", "machinery"}


def module_name(path):
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1]) if rel.name == "__init__" else ".".join(rel.parts)


MODULES = {module_name(p): p for p in [*ROOT.glob("*.py"), *(p for d in PACKAGES for p in (ROOT / d).glob("*.py"))]}


def imports(name):
    """The project modules a module imports, at its top or inside a function (`from colbench import sandbox`:
    colbench.sandbox)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found & set(MODULES) - {name}


def test_the_top_level_is_the_stages_and_the_packages_stand_apart():
    assert {p.stem for p in ROOT.glob("*.py")} == TOP
    assert {p.parent.name for p in ROOT.glob("*/__init__.py")} == PACKAGES
    graph = {name: imports(name) for name in MODULES}
    assert graph["common"] == set()
    colbench = {name for name in MODULES if name.split(".")[0] == "colbench"}
    assert all(deps <= colbench | {"common"} for name, deps in graph.items() if name in colbench), \
        {n: graph[n] for n in colbench}
    assert {name for name, deps in graph.items() if "machinery.training" in deps} == {"train_critic", "train_dpo"}
    assert {name for name, deps in graph.items() if "credit" in deps} == set()
    assert "colbench.sandbox" not in graph["colbench"]

    def cycle_from(name, path):
        for dep in graph[name] - {name.split(".")[0]}:  # a package's module may use its package's rules
            if dep in path:
                return path[path.index(dep):] + [dep]
            if found := cycle_from(dep, path + [dep]):
                return found
        return None
    assert all(cycle_from(name, [name]) is None for name in graph), [cycle_from(n, [n]) for n in graph]
