"""Size limits on the Python shipped in the package and in tools/ (issue
38): no function over LIMIT lines of code (its docstring not counted: that
is documentation) and no class over CLASS_LIMIT. Those still over are
listed in DEBT with their size today; the test fails when a new one
appears, when a listed one grows, and when a listed one has been brought
under the limit but is still listed. The Rust side has its own test
(tests/code_size.rs)."""

import ast
import os
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIRS = ("python/memplan", "tools", "benchmarks")
LIMIT = 120
CLASS_LIMIT = 250

# (file, qualified name): lines today. Shrink them; never add to this list.
DEBT = {
}


def _docstring_lines(node) -> int:
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0].end_lineno - body[0].lineno + 1
    return 0


def sizes(path: str):
    """(qualified name, kind, lines without the docstring) of every
    function and class in `path`."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                lines = child.end_lineno - child.lineno + 1 - _docstring_lines(child)
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                out.append((name, kind, lines))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def over_the_limits():
    """{(file, name): (kind, lines)} over the limits, and how many files
    were read."""
    found, read = {}, 0
    for d in DIRS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, d)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
                read += 1
                for name, kind, lines in sizes(path):
                    if lines > (CLASS_LIMIT if kind == "class" else LIMIT):
                        found[(rel, name)] = (kind, lines)
    return found, read


class CodeSize(unittest.TestCase):
    def test_the_measure_leaves_out_docstrings(self):
        import tempfile

        src = 'def f():\n    """One\n    two."""\n    return 1\n\n\nclass C:\n    def g(self):\n        pass\n'
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as t:
            t.write(src)
        try:
            self.assertEqual(sizes(t.name), [("f", "function", 2), ("C", "class", 3), ("C.g", "function", 2)])
        finally:
            os.unlink(t.name)

    def test_no_function_or_class_grows_past_the_limits(self):
        found, read = over_the_limits()
        self.assertGreater(read, 40, "the package's files were not found")
        problems = []
        for (rel, name), (kind, lines) in sorted(found.items()):
            limit = CLASS_LIMIT if kind == "class" else LIMIT
            was = DEBT.get((rel, name))
            if was is None:
                problems.append(f"{rel}: {kind} {name} has {lines} lines (limit {limit}): split it")
            elif lines > was:
                problems.append(f"{rel}: {kind} {name} grew from {was} to {lines} lines (limit {limit}): split it")
        for key in DEBT:
            if key not in found:
                problems.append(f"{key[0]}: {key[1]} is within the limit now (or gone): remove it from DEBT")
        self.assertEqual(problems, [], "\n".join(problems))


if __name__ == "__main__":
    unittest.main()
