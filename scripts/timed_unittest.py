"""`python -m unittest discover` that also says where the time went: each
test's seconds, written to a TSV file (slowest first) and the slowest 20
printed after the run. Used by scripts/python_tests.sh and scripts/test.sh
(docs/testing.md has the table of a clean run).

    python scripts/timed_unittest.py OUT.tsv -s python/tests [-t TOP] [-p PATTERN]
"""

import os
import sys
import time
import unittest

# As `python -m unittest` from the repository root: the root on the path
# (the tests import the repository's benchmarks/), not this folder.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TimedResult(unittest.TextTestResult):
    """A verbose text result that records each test's wall time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.times = []
        self._t0 = None

    def startTest(self, test):
        self._t0 = time.monotonic()
        super().startTest(test)

    def stopTest(self, test):
        self.times.append((time.monotonic() - self._t0, test.id()))
        super().stopTest(test)


def main(argv):
    out, rest = argv[0], argv[1:]
    start = rest[rest.index("-s") + 1]
    top = rest[rest.index("-t") + 1] if "-t" in rest else None
    pattern = rest[rest.index("-p") + 1] if "-p" in rest else "test*.py"
    suite = unittest.defaultTestLoader.discover(start, pattern=pattern, top_level_dir=top)
    t0 = time.monotonic()
    result = unittest.TextTestRunner(verbosity=2, resultclass=TimedResult).run(suite)
    total = time.monotonic() - t0
    times = sorted(result.times, reverse=True)
    with open(out, "w") as f:
        f.write("seconds\ttest\n")
        for s, name in times:
            f.write(f"{s:.1f}\t{name}\n")
    print(f"\n{len(times)} tests in {total:.0f} s; the slowest:", file=sys.stderr)
    for s, name in times[:20]:
        print(f"  {s:7.1f} s  {name}", file=sys.stderr)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
