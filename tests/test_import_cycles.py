"""No import cycle anywhere in jax_mila, and the package edges the design names.

The graph is read from the source (ast), not from a running interpreter, so every import counts
whether or not it has run: module-level and function-level ones, absolute and relative ones.
An import of a.b.c also imports the packages a and a.b (their __init__ runs first), so it is an
edge to each of them, except to the importing module's own enclosing packages: those are
already being imported when the module runs. Importing a name that is not a submodule from an
enclosing package (``from jax_mila.gemma4 import prefill`` inside jax_mila/gemma4/) does count:
that name exists only once the package's __init__ has run far enough.
"""

from __future__ import annotations

import ast
import os
import tempfile
import textwrap

from absl.testing import absltest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jax_mila")


def _modules(root: str) -> dict[str, str]:
    """Dotted module name -> file, for every .py file under the package directory `root`."""
    base = os.path.dirname(root)
    out = {}
    for directory, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            parts = os.path.relpath(path, base)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _with_ancestors(name: str) -> list[str]:
    return _ancestors(name) + [name]


def import_graph(root: str) -> dict[str, set[str]]:
    """module -> the modules of the package under `root` that importing it imports directly."""
    modules = _modules(root)
    graph = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        is_package = os.path.basename(path) == "__init__.py"
        enclosing = set(_ancestors(module)) | ({module} if is_package else set())
        targets = set()  # imported modules (a dotted target implies its ancestors)
        names_from = set()  # packages a non-submodule name is imported from
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    targets.add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    package = module if is_package else module.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{node.module}" if node.module else package
                else:
                    base = node.module
                targets.add(base)
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        targets.add(f"{base}.{alias.name}")
                    else:
                        names_from.add(base)
        edges = set()
        for target in targets:
            edges.update(m for m in _with_ancestors(target)
                         if m in modules and m not in enclosing and m != module)
        edges.update(m for m in names_from if m in modules and m != module)
        graph[module] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly connected
    component of more than one module, or of one that imports itself."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(v):  # Tarjan's algorithm, iterative
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v), on_stack.add(v)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == node:
                            break
                    components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child), on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        members = set(component)
        start = min(component)
        if len(component) == 1 and start not in graph[start]:
            continue
        # A shortest path from start back to itself inside the component (breadth first).
        previous, frontier, found = {}, [start], None
        while frontier and found is None:
            nxt = []
            for node in frontier:
                for child in sorted(graph[node] & members):
                    if child == start:
                        found = node
                        break
                    if child not in previous:
                        previous[child] = node
                        nxt.append(child)
                if found is not None:
                    break
            frontier = nxt
        path = [found]
        while path[-1] != start:
            path.append(previous[path[-1]])
        cycles.append([start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start])
    return cycles


def _describe(cycles) -> str:
    return "\n".join(" -> ".join(c) for c in cycles)


class ImportCycleTest(absltest.TestCase):

    def test_jax_mila_has_no_import_cycle(self):
        graph = import_graph(ROOT)
        self.assertGreater(len(graph), 40)  # the package was found and read
        cycles = find_cycles(graph)
        self.assertEqual(cycles, [], f"import cycles in jax_mila:\n{_describe(cycles)}")

    def test_layers_do_not_import_layers_above_them(self):
        # parallel/ holds sharding and collective primitives: nothing of a model or of what
        # runs one; nn/ holds modules that are told how they run; the engine runs a model
        # through the methods it provides, so it imports no model.
        rules = {"jax_mila.parallel": ("jax_mila.gemma4", "jax_mila.engine", "jax_mila.nn"),
                 "jax_mila.nn": ("jax_mila.parallel", "jax_mila.gemma4", "jax_mila.engine"),
                 "jax_mila.engine": ("jax_mila.gemma4",)}
        bad = []
        for module, edges in import_graph(ROOT).items():
            for layer, forbidden in rules.items():
                if module == layer or module.startswith(layer + "."):
                    bad += [f"{module} -> {t}" for t in sorted(edges)
                            if any(t == f or t.startswith(f + ".") for f in forbidden)]
        self.assertEqual(bad, [])


class GraphReaderTest(absltest.TestCase):
    """The reader on a small package written here: it sees each kind of edge and names the
    cycle it closes."""

    def package(self, files: dict[str, str]) -> str:
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        root = os.path.join(tmp.name, "pkg")
        for name, text in {"__init__.py": "", **files}.items():
            path = os.path.join(root, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(textwrap.dedent(text))
        return root

    def test_edges(self):
        root = self.package({
            "a.py": "import pkg.sub.c\n",
            "b.py": "def f():\n    from .sub import c, helper\n",
            "sub/__init__.py": "from . import c\nfrom pkg.sub.c import x\n",
            "sub/c.py": "from .. import a\nfrom pkg import b as _b\nimport os\n",
            "d.py": "from pkg.sub import helper\nfrom pkg import sub\n",
        })
        graph = import_graph(root)
        self.assertEqual(graph["pkg.a"], {"pkg.sub", "pkg.sub.c"})   # with the package
        self.assertEqual(graph["pkg.b"], {"pkg.sub", "pkg.sub.c"})   # function level, relative
        self.assertEqual(graph["pkg.sub"], {"pkg.sub.c"})            # its own package dropped
        self.assertEqual(graph["pkg.sub.c"], {"pkg.a", "pkg.b"})
        self.assertEqual(graph["pkg.d"], {"pkg.sub"})
        self.assertEqual(graph["pkg"], set())

    def test_names_the_cycle(self):
        # pkg.x imports pkg.y.z, which runs pkg.y's __init__ first, and that imports pkg.x.
        root = self.package({"x.py": "def f():\n    import pkg.y.z\n",
                             "y/__init__.py": "from pkg.x import f\n",
                             "y/z.py": "",
                             "w.py": "from pkg.y import z\n"})
        cycles = find_cycles(import_graph(root))
        self.assertCountEqual(cycles, [["pkg.x", "pkg.y", "pkg.x"]])

    def test_a_name_from_the_enclosing_package_counts(self):
        root = self.package({"sub/__init__.py": "from pkg.sub.m import g\n",
                             "sub/m.py": "from pkg.sub import other_name\ndef g(): pass\n"})
        self.assertEqual(find_cycles(import_graph(root)), [["pkg.sub", "pkg.sub.m", "pkg.sub"]])


if __name__ == "__main__":
    absltest.main()
