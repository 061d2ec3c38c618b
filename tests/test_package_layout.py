"""The package's shape, as the README's Layout section states it: subpackages that import one way (each only those
listed before it, and the few shared top-level modules, which import no subpackage), the modules of a package
importing one way too, no module over 400 lines, at most 8 top-level modules besides the thin `python -m
clip_jax.X` entries, stop signals handled in one module and other packages' internals imported in one, and no
file left with a merge's conflict markers. Read from the source (its
`import` statements, wherever they are in a module), not by importing it."""

import ast
import collections
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "clip_jax")
MAX_LINES, MAX_TOP_LEVEL, MAX_ENTRY_LINES = 400, 8, 40


def modules() -> dict[str, str]:
    """{dotted name: path} of every module of the package."""
    found = {}
    for root, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                found[os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")] = path
    return found


def unit(module: str) -> str:
    """The subpackage a module belongs to (`training`), the top-level module itself (`clip_jax.errors`), or
    `clip_jax` for a name the package's `__init__` defines."""
    parts = module.split(".")
    if os.path.isdir(os.path.join(PACKAGE, parts[1])):
        return parts[1]
    if os.path.isfile(os.path.join(PACKAGE, parts[1] + ".py")):
        return ".".join(parts[:2])
    return "clip_jax"


def imported_units(path: str) -> set[str]:
    """The units (see `unit`) a module's import statements name."""
    names = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return {unit(name) for name in names if name.startswith("clip_jax.")}


def readme_order() -> list[str]:
    layout = open(os.path.join(REPO, "README.md")).read().split("## Layout", 1)[1]
    return re.findall(r"^clip_jax/(\w+)/ ", layout, re.M)


def is_entry(path: str) -> bool:
    """A thin command entry: `if __name__ == "__main__":` over another module's code, in a few lines."""
    text = open(path).read()
    return '__name__ == "__main__"' in text and len(text.splitlines()) <= MAX_ENTRY_LINES


def test_each_subpackage_imports_only_those_the_readme_lists_before_it():
    order = readme_order()
    assert sorted(order) == sorted(name for name in os.listdir(PACKAGE)
                                   if os.path.isfile(os.path.join(PACKAGE, name, "__init__.py")))
    imports = collections.defaultdict(set)
    for module, path in modules().items():
        imports[unit(module)] |= imported_units(path) - {unit(module)}
    # the package's __init__ (which imports no subpackage: its names load on first use) and the top-level modules
    # that are not command entries
    shared = {u for u in imports if "." in u and not is_entry(os.path.join(REPO, *u.split(".")) + ".py")} - {
        "clip_jax.__init__", "clip_jax.__main__"}
    later = {s: sorted(t for t in imports[s] if t in order and order.index(t) > order.index(s)) for s in order}
    assert not any(later.values()), f"subpackages importing one listed after them: {later}"
    outside = {s: sorted(t for t in imports[s] if t.startswith("clip_jax.") and t not in shared) for s in order}
    assert not any(outside.values()), f"subpackages importing a top-level module that is not shared: {outside}"
    reaching = {m: sorted(t for t in imports[m] if t in order) for m in shared | {"clip_jax.__init__"}}
    assert not any(reaching.values()), f"shared top-level modules importing a subpackage: {reaching}"
    sentence = re.search(r"Each subpackage imports only those listed before it \(and the top-level ([^)]*)\)",
                         open(os.path.join(REPO, "README.md")).read())
    assert sentence and set(re.findall(r"\w+", sentence[1])) >= {m.split(".")[1] for m in shared}


def imported_modules(path: str, known: dict[str, str]) -> set[str]:
    """The modules of the package (names in `known`) a module's import statements name, wherever they are."""
    names = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    found = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        found |= {name} if name else set()
    return found


def import_loop(graph: dict[str, set[str]]) -> list[str]:
    """One loop of `graph` (module -> the modules it imports) as [a, b, ..., a], or [] when there is none."""
    done, path = set(), []

    def visit(module):
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return []
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            loop = visit(imported)
            if loop:
                return loop
        path.pop()
        done.add(module)
        return []

    for module in sorted(graph):
        loop = visit(module)
        if loop:
            return loop
    return []


def test_the_modules_of_each_package_import_one_way():
    """No loop among the modules of one package (its `__init__` aside), counting imports inside functions: where two
    modules need each other, a piece sits in the wrong one."""
    known = {module: path for module, path in modules().items() if not module.endswith(".__init__")}
    graph = {module: {m for m in imported_modules(path, known) if m.rpartition(".")[0] == module.rpartition(".")[0]}
             - {module} for module, path in known.items()}
    assert not import_loop(graph), " -> ".join(import_loop(graph))
    assert import_loop({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}}) == ["a.x", "a.y", "a.z", "a.x"]


def test_no_module_is_over_400_lines():
    long = {module: n for module, path in modules().items() if (n := len(open(path).read().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_top_level_holds_at_most_8_modules_besides_the_thin_command_entries():
    top = [name for name in os.listdir(PACKAGE) if name.endswith(".py") and name not in ("__init__.py", "__main__.py")]
    kept = sorted(name for name in top if not is_entry(os.path.join(PACKAGE, name)))
    assert len(kept) <= MAX_TOP_LEVEL, kept
    assert len(top) > len(kept)  # the entries are there, and recognised


def test_stop_signals_are_named_and_handled_in_one_module():
    signal_names = {"SIGINT", "SIGTERM", "signal", "pthread_sigmask"}
    found = set()
    for module, path in modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if (isinstance(node, ast.Attribute) and node.attr in signal_names and isinstance(node.value, ast.Name)
                    and node.value.id == "signal") or (isinstance(node, ast.Name) and node.id == "STOP_SIGNALS"
                                                       and isinstance(node.ctx, ast.Store)):
                found.add(module)
    assert found == {"clip_jax.runtime.stop_signals"}


def test_other_packages_internals_are_imported_in_one_module():
    found = set()
    for module, path in modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            if any(not name.startswith("clip_jax") and any(part.startswith("_") for part in name.split(".")[1:])
                   for name in names):
                found.add(module)
    assert found == {"clip_jax.runtime.private_apis"}


def test_no_file_keeps_a_merge_conflict_marker():
    marker = re.compile(r"^(<{7} |={7}$|>{7} )", re.M)
    skipped = {".git", ".venv", "__pycache__", "clipjax_train.egg-info"}
    outputs = {os.path.join(REPO, "logs"), os.path.join(REPO, "data")}  # the demo's run and shards
    found = []
    for root, folders, names in os.walk(REPO):
        folders[:] = [f for f in folders if f not in skipped and os.path.join(root, f) not in outputs]
        for name in names:
            if name.endswith((".py", ".md", ".sh", ".sbatch", ".txt", ".json", ".cfg", ".toml")) or name == "run":
                path = os.path.join(root, name)
                try:
                    text = open(path, encoding="utf-8").read()
                except UnicodeDecodeError:
                    continue
                found += [f"{os.path.relpath(path, REPO)}:{text[:m.start()].count(chr(10)) + 1}"
                          for m in marker.finditer(text)]
    assert not found, found
