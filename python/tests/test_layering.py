"""No import rings in the Python package nor in the benchmarks (issues 38
and 59, "Layering"; the Rust side is tests/layering.rs): no module imports
a module that imports it back. Every import counts: at import time, inside
a function (made when called) and under ``if TYPE_CHECKING:`` (a type
that needs the other module is a ring in the design even where Python
tolerates it; a structural type, ``typing.Protocol``, breaks it);
``from package import submodule`` counts as importing the submodule."""

import ast
import os
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def modules(root: str, package: str = "memplan"):
    """{module name: path} of every module of `package` under `root`."""
    out = {}
    for d, _, files in os.walk(os.path.join(root, package)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _import_nodes(tree: ast.Module):
    """Every import statement of the module, wherever it is."""
    return (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))


def imports(name: str, path: str, mods) -> set:
    """The modules of `mods` that module `name` imports."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    out = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
        out.update(subs)
        if len(subs) < len(node.names):
            out.add(base)
    return {m for m in out if m in mods and m != name}


def rings(root: str, package: str = "memplan"):
    """The import rings (strongly connected sets of two or more modules)."""
    mods = modules(root, package)
    graph = {m: imports(m, p, mods) for m, p in mods.items()}
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm; the package is a few dozen modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            ring = []
            while True:
                w = stack.pop()
                on.discard(w)
                ring.append(w)
                if w == v:
                    break
            if len(ring) > 1:
                found.append(sorted(ring))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found, len(mods)


class Layering(unittest.TestCase):
    def test_the_package_has_no_import_rings(self):
        found, count = rings(ROOT)
        self.assertGreater(count, 30, "the package's modules were not found")
        self.assertEqual(found, [], f"import rings: {found}")

    def test_the_benchmarks_have_no_import_rings(self):
        found, count = rings(os.path.dirname(ROOT), "benchmarks")
        self.assertGreater(count, 5, "the benchmarks' modules were not found")
        self.assertEqual(found, [], f"import rings: {found}")

    def test_the_package_holds_no_benchmarks(self):
        # What `pip install ./python` installs: the library. The benchmarks
        # live in the repository's benchmarks/ (issue 59).
        names = modules(ROOT)
        self.assertEqual(sorted(n for n in names if "bench" in n.rsplit(".", 1)[-1]), [])
        self.assertNotIn("memplan.torch.workloads", names)
        self.assertIn("memplan.torch.export.workloads", names)  # the export's named models

    def test_a_ring_is_found_through_lazy_and_type_checking_imports(self):
        with tempfile.TemporaryDirectory() as root:
            pkg = os.path.join(root, "p")
            os.makedirs(pkg)
            files = {
                "__init__.py": "from . import a\n",
                "a.py": "from .b import f\n",
                "b.py": "from . import c\ndef f():\n    pass\n",
                "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import f\n",
                "d.py": "def g():\n    from . import e\n",
                "e.py": "try:\n    from .d import g\nexcept ImportError:\n    pass\n",
                "f.py": "from . import a\n",
            }
            for name, text in files.items():
                with open(os.path.join(pkg, name), "w") as f:
                    f.write(text)
            found, count = rings(root, "p")
            self.assertEqual(count, 7)
            # b <-> c through c's TYPE_CHECKING import; d <-> e through d's
            # import inside a function; f imports a ring without being in it.
            self.assertEqual(sorted(found), [["p.b", "p.c"], ["p.d", "p.e"]])


if __name__ == "__main__":
    unittest.main()
