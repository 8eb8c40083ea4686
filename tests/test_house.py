"""The house rules of DESIGN.md §4 that can be counted, counted over ember/ with `ast`.

Where the code still breaks a rule, the exception is named below with its size
today: it may shrink or go, never grow, and no new one may join it. An
exception that is gone must leave the list too, so the list says what is left.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "ember"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50
MAX_PARAMETERS = 7
MAX_LOOSE_MODULES = 6

# Signatures over 7 parameters (self aside; CLI commands are exempt): (module, function) -> parameters today.
WIDE_SIGNATURES = {
    ("channels/gateway/native_api.py", "__init__"): 8,
    ("runtime/loop.py", "__init__"): 10,
}
# Packages each layer may not import: the arrows of DESIGN.md §4 point down only.
ABOVE = {
    "channels": ("ember.app", "ember.cli", "ember.config"),
    "runtime": ("ember.app", "ember.cli", "ember.config", "ember.channels"),
    "pipeline": ("ember.app", "ember.cli", "ember.config", "ember.channels", "ember.runtime"),
    "memory": ("ember.app", "ember.cli", "ember.config", "ember.channels", "ember.runtime", "ember.pipeline"),
    "store": ("ember.app", "ember.cli", "ember.config", "ember.channels", "ember.runtime", "ember.pipeline"),
    "bus": ("ember.app", "ember.cli", "ember.config", "ember.channels", "ember.runtime", "ember.pipeline"),
    "core": ("ember.app", "ember.cli", "ember.config", "ember.channels", "ember.runtime", "ember.pipeline",
             "ember.memory", "ember.store", "ember.bus", "ember.tools", "ember.models", "ember.skills"),
}


def modules() -> Iterator[tuple[str, ast.Module, int]]:
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        yield path.relative_to(ROOT).as_posix(), ast.parse(source), len(source.splitlines())


def functions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    yield from (node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef))


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = function.args
    names = [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, (args.vararg, args.kwarg))]
    return len([name for name in names if name.arg not in ("self", "cls")])


def is_cli_command(module: str, function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return module.startswith("cli/") and any("command" in ast.unparse(d) or "callback" in ast.unparse(d)
                                             for d in function.decorator_list)


def imported(tree: ast.Module, module: str) -> set[str]:
    """The ember modules a module imports at run time (type-checking imports aside)."""
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
               and ast.unparse(block.test).endswith("TYPE_CHECKING") for node in ast.walk(block)}
    package = module.removesuffix(".py").replace("/", ".").split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(["ember", *package[:len(package) - node.level + 1], *filter(None, [base])])
            found.update(f"{base}.{alias.name}" for alias in node.names)
            found.add(base)
    return {name for name in found if name == "ember" or name.startswith("ember.")}


def over(limits: dict, found: dict) -> list[str]:
    grown = [f"{key}: {size} (allowed {limits[key]})" if key in limits else f"{key}: {size} (new)"
             for key, size in sorted(found.items()) if size > limits.get(key, 0)]
    shrunk = [f"{key}: {found[key]} now, lower its allowance" for key in sorted(limits)
              if key in found and found[key] < limits[key]]
    gone = [f"{key} is within the rule now: take it off the list" for key in sorted(limits) if key not in found]
    return grown + shrunk + gone


def test_no_module_is_over_400_lines() -> None:
    assert [(name, lines) for name, _, lines in modules() if lines > MAX_MODULE_LINES] == []


def test_no_function_is_over_50_lines() -> None:
    found = {(name, f.name): f.end_lineno - f.lineno + 1 for name, tree, _ in modules() for f in functions(tree)
             if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES}
    assert found == {}


def test_signatures_stay_within_7_parameters_but_the_named_ones() -> None:
    found: dict[tuple[str, str], int] = {}
    for name, tree, _ in modules():
        for function in functions(tree):
            if parameters(function) > MAX_PARAMETERS and not is_cli_command(name, function):
                key = (name, function.name)
                found[key] = max(found.get(key, 0), parameters(function))
    assert over(WIDE_SIGNATURES, found) == []


def test_only_the_store_and_the_composition_root_name_sql_classes() -> None:
    found = {}
    for name, tree, _ in modules():
        if name.startswith(("store/", "app/")):
            continue
        named = {node.id if isinstance(node, ast.Name) else node.name for node in ast.walk(tree)
                 if isinstance(node, ast.Name | ast.alias)}
        if sql := {each for each in named if each.startswith("Sql")}:
            found[name] = sql
    assert found == {}


# Where a raw connection (`AdminDatabase.write()` / `read()`) may be opened: the engines themselves,
# migrating and copying a store, and `ember doctor`. Every store works in units of work (`run_write`).
ADMIN_MODULES = {"store/engine.py", "store/copy.py", "store/sqlite/database.py", "store/postgres.py",
                 "cli/doctor.py"}


def test_only_the_admin_surface_opens_raw_connections() -> None:
    found = [f"{name}:{node.lineno}" for name, tree, _ in modules() if name not in ADMIN_MODULES
             for node in ast.walk(tree) if isinstance(node, ast.withitem | ast.Await)
             and isinstance(call := node.context_expr if isinstance(node, ast.withitem) else node.value, ast.Call)
             and isinstance(call.func, ast.Attribute) and call.func.attr in ("read", "write") and not call.args
             and "db" in ast.unparse(call.func.value)]
    assert found == []


def test_the_top_of_the_package_keeps_a_handful_of_modules() -> None:
    loose = [path.name for path in ROOT.glob("*.py") if path.name not in ("__init__.py", "__main__.py")]
    assert len(loose) <= MAX_LOOSE_MODULES, loose


def test_no_test_asserts_a_wall_clock_time() -> None:
    """Speed is measured by bench/, not asserted: a test asserts what a person would notice."""
    clocks = ("monotonic()", "perf_counter()", "time.time()")
    found = [f"{path.name}:{node.lineno}" for path in sorted(ROOT.parent.joinpath("tests").rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, ast.Assert)
             and any(clock in ast.unparse(node.test) for clock in clocks)]
    assert found == []


@pytest.mark.parametrize("layer", sorted(ABOVE))
def test_a_layer_imports_nothing_above_it(layer: str) -> None:
    upward = sorted(f"{name} imports {target}" for name, tree, _ in modules() if name.startswith(f"{layer}/")
                    for target in imported(tree, name) if target.startswith(ABOVE[layer]))
    assert upward == []


@pytest.mark.parametrize("layer", ["channels", "runtime", "pipeline", "tools", "skills"])
def test_a_layer_above_the_store_knows_it_by_its_protocols_only(layer: str) -> None:
    """Value types the runtime shares with the store live in core/; the rest of store/ is its own."""
    named = sorted(f"{name} imports {target}" for name, tree, _ in modules() if name.startswith(f"{layer}/")
                   for target in imported(tree, name)
                   if target.startswith("ember.store") and not target.startswith("ember.store.protocols"))
    assert named == []


def test_no_modules_import_each_other_in_a_circle() -> None:
    graph = {}
    for name, tree, _ in modules():
        graph[name] = {_file_of(target) for target in imported(tree, name)} - {None, name}
    assert _circles(graph) == []


def _file_of(dotted: str) -> str | None:
    parts = dotted.split(".")[1:]
    while parts:
        for candidate in ("/".join(parts) + ".py", "/".join(parts) + "/__init__.py"):
            if (ROOT / candidate).is_file():
                return None if candidate.endswith("__init__.py") else candidate
        parts.pop()
    return None


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found
