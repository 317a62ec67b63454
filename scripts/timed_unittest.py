"""`python -m unittest discover` that also says where the time went: each
test's seconds, written to a TSV file (slowest first) and the slowest 20
printed after the run. Used by scripts/python_tests.sh and scripts/test.sh
(docs/testing.md has the table of a clean run).

    python scripts/timed_unittest.py OUT.tsv -s python/tests [-t TOP] [-p PATTERN] [-j JOBS]

With `-j JOBS` (default: the machine's cores) the test classes run in JOBS
worker processes, each class whole in one worker (its setUpClass once), the
longest first: by the seconds OUT.tsv holds from an earlier run, else by
the class's source lines. Each worker gets its share of the cores for
PyTorch's threads (`OMP_NUM_THREADS`). `-j 1` runs everything in this
process, in order.
"""

import inspect
import os
import sys
import time
import traceback
import unittest
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

# As `python -m unittest` from the repository root: the root on the path
# (the tests import the repository's benchmarks/), not this folder.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT


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


def _tests(suite):
    """The test cases of a (nested) suite, in order."""
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _tests(item)
        else:
            yield item


def _groups(suite):
    """The suite's tests grouped by class: [(class id, [test ids])]. A test
    the loader could not import is its own group (it fails when run)."""
    groups = {}
    for test in _tests(suite):
        name = test.id()
        key = name.rsplit(".", 1)[0] if "." in name else name
        groups.setdefault(key, []).append(name)
    return list(groups.items())


def _weight(key, ids, earlier):
    """How long a class is expected to take: its tests' seconds in an
    earlier run, else its source lines (a class added since counts by its
    size)."""
    known = [earlier[i] for i in ids if i in earlier]
    if len(known) == len(ids):
        return sum(known)
    module, _, cls = key.rpartition(".")
    try:
        obj = getattr(sys.modules.get(module) or __import__(module, fromlist=[cls]), cls)
        lines = len(inspect.getsource(obj).splitlines())
    except Exception:
        lines = 0
    # Roughly a second per ten lines: big classes hold the model zoos.
    return sum(known) + lines / 10.0


def _earlier(out):
    """Each test's seconds in the run that last wrote OUT.tsv."""
    try:
        with open(out) as f:
            rows = [line.rstrip("\n").split("\t") for line in f][1:]
        return {name: float(s) for s, name in rows}
    except (OSError, ValueError):
        return {}


class _Collect(unittest.TestResult):
    """A worker's result: each test's outcome, seconds and report text,
    picklable for the parent."""

    def __init__(self):
        super().__init__()
        self.rows = []
        self._t0 = None

    def startTest(self, test):
        self._t0 = time.monotonic()
        super().startTest(test)

    def _row(self, test, outcome, err=None, reason=None):
        text = self._exc_info_to_string(err, test) if err else (reason or "")
        seconds = time.monotonic() - self._t0 if self._t0 is not None else 0.0
        self.rows.append((test.id(), outcome, seconds, text))

    def stopTest(self, test):
        super().stopTest(test)
        self._t0 = None

    def addSuccess(self, test):
        super().addSuccess(test)
        self._row(test, "ok")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._row(test, "FAIL", err)

    def addError(self, test, err):
        super().addError(test, err)
        # setUpClass / tearDownClass errors come as a _ErrorHolder.
        self._row(test, "ERROR", err)

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._row(test, "skipped", reason=reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._row(test, "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._row(test, "unexpected success")

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            outcome = "FAIL" if issubclass(err[0], test.failureException) else "ERROR"
            self._row(subtest, outcome, err)


def _run_group(ids):
    """Runs one class's tests in this worker; returns its rows."""
    result = _Collect()
    try:
        suite = unittest.defaultTestLoader.loadTestsFromNames(ids)
        suite.run(result)
    except Exception:
        result.rows.append((ids[0], "ERROR", 0.0, traceback.format_exc()))
    return result.rows


def _worker(top, threads):
    """A worker's setup: the discovery's top-level folder first on its
    import path, as `discover` puts it in this process, and its share of
    the cores for PyTorch's and OpenMP's threads (set before any test
    imports torch; the ranks and commands its tests start inherit it), so
    the workers together do not ask for more threads than there are
    cores."""
    if top not in sys.path:
        sys.path.insert(0, top)
    os.environ["OMP_NUM_THREADS"] = str(threads)


def _parallel(suite, out, jobs, top):
    earlier = _earlier(out)
    groups = _groups(suite)
    groups.sort(key=lambda g: _weight(g[0], g[1], earlier), reverse=True)
    rows, failed, skipped, t0 = [], [], 0, time.monotonic()
    print(f"{sum(len(i) for _, i in groups)} tests in {len(groups)} classes on {jobs} workers",
          file=sys.stderr, flush=True)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"),
                             initializer=_worker, initargs=(top, max(1, (os.cpu_count() or 1) // jobs))) as pool:
        futures = {pool.submit(_run_group, ids): key for key, ids in groups}
        for future in as_completed(futures):
            try:
                got = future.result()
            except Exception as e:  # a worker that died (a crash, a kill)
                got = [(futures[future], "ERROR", 0.0, f"the worker running it died: {e!r}\n")]
            for name, outcome, seconds, text in got:
                print(f"{name} ... {outcome} ({seconds:.1f} s)", file=sys.stderr, flush=True)
                rows.append((seconds, name))
                skipped += outcome == "skipped"
                if outcome in ("FAIL", "ERROR", "unexpected success"):
                    failed.append((outcome, name, text))
    total = time.monotonic() - t0
    for outcome, name, text in failed:
        print(f"\n{'=' * 70}\n{outcome}: {name}\n{'-' * 70}\n{text}", file=sys.stderr)
    print(f"\nRan {len(rows)} tests in {total:.1f}s", file=sys.stderr)
    extra = f" (skipped={skipped})" if skipped else ""
    print(f"FAILED (failures and errors={len(failed)}){extra}" if failed else f"OK{extra}",
          file=sys.stderr)
    return rows, total, not failed


def main(argv):
    out, rest = argv[0], argv[1:]
    start = rest[rest.index("-s") + 1]
    top = rest[rest.index("-t") + 1] if "-t" in rest else None
    pattern = rest[rest.index("-p") + 1] if "-p" in rest else "test*.py"
    jobs = int(rest[rest.index("-j") + 1]) if "-j" in rest else (os.cpu_count() or 1)
    suite = unittest.defaultTestLoader.discover(start, pattern=pattern, top_level_dir=top)
    if jobs > 1:
        times, total, ok = _parallel(suite, out, jobs, os.path.abspath(top or start))
    else:
        t0 = time.monotonic()
        result = unittest.TextTestRunner(verbosity=2, resultclass=TimedResult).run(suite)
        times, total, ok = result.times, time.monotonic() - t0, result.wasSuccessful()
    times = sorted(times, reverse=True)
    with open(out, "w") as f:
        f.write("seconds\ttest\n")
        for s, name in times:
            f.write(f"{s:.1f}\t{name}\n")
    print(f"\n{len(times)} tests in {total:.0f} s; the slowest:", file=sys.stderr)
    for s, name in times[:20]:
        print(f"  {s:7.1f} s  {name}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
