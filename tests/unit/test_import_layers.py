"""The package's import graph has no cycle, and no module uses another module's _private names.

An ast pass over mpitrain/ (and kernels/, installed as mpitrain.kernels): every import of an
mpitrain module -- at the top of a file or inside a function, since a lazy import that closes a
cycle is still a cycle -- is an edge. Importing a package's submodule is an edge to that module
only (Python also runs the parents' __init__, which every package does; those edges are left
out, as import-cycle checkers do).
"""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _modules():
    """module name -> source path."""
    found = {}
    for root, prefix in ((REPO / "mpitrain", "mpitrain"), (REPO / "kernels", "mpitrain.kernels")):
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix] + parts)] = path
    return found


MODULES = _modules()


def _names_bound_by(package):
    """Names a package's __init__.py binds to something other than its submodule of that name
    (``from mpitrain.comm.join import join``: ``mpitrain.comm.join`` is then the function)."""
    path = MODULES.get(package)
    if path is None or path.name != "__init__.py":
        return set()
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names
                      if f"{node.module}.{a.name}" not in MODULES}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


BOUND = {name: _names_bound_by(name) for name in MODULES}


def _resolve(name):
    """The module an import of ``name`` loads (the longest known prefix), or None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module, path):
    """[(imported module, {local name bound to a module}, [(line, private name used)])]."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges, bound, private = set(), {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name)
                if target:
                    edges.add(target)
                    bound[alias.asname or alias.name.partition(".")[0]] = (
                        target if alias.asname else alias.name.partition(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in MODULES and alias.name not in BOUND.get(base, ()):   # a submodule
                    edges.add(full)
                    bound[alias.asname or alias.name] = full
                elif _resolve(base):
                    edges.add(_resolve(base))
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append((node.lineno, f"{base}.{alias.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in bound and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            private.append((node.lineno, f"{bound[node.value.id]}.{node.attr}"))
    edges.discard(module)
    return edges, private


GRAPH, PRIVATE = {}, {}
for _name, _path in MODULES.items():
    GRAPH[_name], PRIVATE[_name] = _imports(_name, _path)


def _cycle():
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(GRAPH.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, stack)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(GRAPH):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_the_checker_sees_the_real_graph():
    assert "mpitrain.comm.world" in GRAPH["mpitrain.comm.process_sets"]
    assert "mpitrain.comm.host" in GRAPH["mpitrain.comm.collectives"]
    assert "mpitrain.comm.device" in GRAPH["mpitrain.comm.collectives"]      # a lazy import
    assert "mpitrain.kernels.cpu" in GRAPH["mpitrain.comm.engine"]


def test_no_import_cycle():
    assert _cycle() is None, " -> ".join(_cycle())


def test_no_module_uses_another_modules_private_names():
    offenders = [f"{module}:{line} uses {name}" for module, uses in sorted(PRIVATE.items())
                 for line, name in uses]
    assert offenders == []


def test_the_comm_layer_has_the_documented_order():
    """Each comm module imports only modules listed before it (comm/__init__.py's order)."""
    order = ["abort", "watchdog", "settings", "kinds", "check", "handles", "world",
             "process_sets", "build_info", "gpu", "ops", "ring", "tree", "hierarchical", "buckets",
             "fusion", "engine", "host", "overlap", "device", "adasum", "collectives", "join",
             "tracing"]
    rank = {f"mpitrain.comm.{m}": i for i, m in enumerate(order)}
    assert set(rank) == {m for m in MODULES if m.startswith("mpitrain.comm.")}
    upward = [f"{m} imports {d}" for m in rank for d in GRAPH[m] if d in rank
              and rank[d] >= rank[m]]
    assert upward == []


# The whole package, bottom to top: each module imports only from its own layer and the ones
# below (docs/architecture.md, "Layers"). Every module lives in its layer's folder (the
# timeline's folder is the runtime layer's, named for its command, python -m mpitrain.timeline);
# the package itself (mpitrain/__init__.py, __main__.py) is the top.
LAYERS = ("kernels", "runtime", "comm", "model", "parallel", "train")
_FOLDERS = {"kernels": "kernels", "runtime": "runtime", "timeline": "runtime", "comm": "comm",
            "nn": "model", "optim": "model", "data": "model", "parallel": "parallel",
            "train": "train", "torch": "train", "tensorflow": "train", "keras": "train",
            "run": "train", "info": "train"}
# Model-layer modules that still reach comm (lazily): to move up, not to grow.
MODEL_USES_OF_COMM = {"mpitrain.nn.sync_batchnorm", "mpitrain.data.sampler"}


def layer_of(module):
    parts = module.split(".")
    if len(parts) == 1:
        return "train"
    return _FOLDERS.get(parts[1], "train")


def test_every_module_imports_only_its_layer_and_below():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = [f"{m} ({layer_of(m)}) imports {d} ({layer_of(d)})"
              for m in sorted(GRAPH) for d in sorted(GRAPH[m])
              if rank[layer_of(d)] > rank[layer_of(m)]]
    assert upward == []


def test_only_the_known_model_modules_use_comm():
    users = {m for m in GRAPH if layer_of(m) == "model"
             and any(layer_of(d) == "comm" for d in GRAPH[m])}
    assert users == MODEL_USES_OF_COMM


def test_every_module_lives_in_a_layer_folder():
    tops = {m.split(".")[1] for m in MODULES if m.count(".") >= 1}
    assert tops - set(_FOLDERS) == {"__main__"}


def test_code_outside_comm_enters_it_by_its_door():
    """Above comm, only ``mpitrain.comm`` itself (comm/__init__.py) is imported."""
    past = [f"{m} imports {d}" for m in sorted(GRAPH) if not m.startswith("mpitrain.comm")
            for d in sorted(GRAPH[m]) if d.startswith("mpitrain.comm.")]
    assert past == []
