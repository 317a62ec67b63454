"""scripts/timed_unittest.py, the runner of the Python tests: with several
workers it must report every failure, error and crash as the serial runner
does (a run that lost one would pass CI), run each class's setUpClass once,
and write each test's seconds."""

import pathlib
import subprocess
import sys
import tempfile
import textwrap
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNNER = ROOT / "scripts" / "timed_unittest.py"

PASSING = '''
import os, unittest
class A(unittest.TestCase):
    setups = 0
    @classmethod
    def setUpClass(cls):
        cls.setups += 1
    def test_one(self):
        self.assertEqual(self.setups, 1)
    def test_two(self):
        self.assertEqual(self.setups, 1)
    def test_subtests(self):
        for i in range(3):
            with self.subTest(i=i):
                self.assertLess(i, 3)
class B(unittest.TestCase):
    def test_skipped(self):
        self.skipTest("a reason")
'''

FAILING = '''
import os, unittest
class Fails(unittest.TestCase):
    def test_wrong(self):
        self.assertEqual(1, 2)
    def test_a_subtest_is_wrong(self):
        for i in range(3):
            with self.subTest(i=i):
                self.assertLess(i, 2)
class SetupFails(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        raise RuntimeError("no fixture")
    def test_never_runs(self):
        pass
class Crashes(unittest.TestCase):
    def test_the_worker_dies(self):
        os._exit(3)
'''


def run(files, jobs):
    with tempfile.TemporaryDirectory() as d:
        for name, text in files.items():
            pathlib.Path(d, name).write_text(textwrap.dedent(text))
        out = pathlib.Path(d, "times.tsv")
        r = subprocess.run([sys.executable, str(RUNNER), str(out), "-s", d, "-j", str(jobs)],
                           capture_output=True, text=True, timeout=300)
        rows = out.read_text().splitlines() if out.exists() else []
    return r, rows


class TimedUnittest(unittest.TestCase):
    def test_a_passing_suite_passes_on_two_workers(self):
        r, rows = run({"test_pass.py": PASSING}, jobs=2)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("OK (skipped=1)", r.stderr)
        # Each test's seconds, under a header.
        self.assertEqual(rows[0], "seconds\ttest")
        self.assertEqual(len(rows), 1 + 4, rows)

    def test_failures_errors_and_crashes_fail_the_run(self):
        for jobs in (1, 2):
            with self.subTest(jobs=jobs):
                r, _ = run({"test_pass.py": PASSING, "test_fail.py": FAILING}, jobs=jobs)
                self.assertNotEqual(r.returncode, 0, r.stderr)
                if jobs == 1:
                    continue  # unittest's own report (os._exit ends the run)
                for what in ("FAIL: test_fail.Fails.test_wrong", "1 != 2",
                             "test_a_subtest_is_wrong (i=2)", "setUpClass (test_fail.SetupFails)",
                             "no fixture", "the worker running it died"):
                    self.assertIn(what, r.stderr)

    def test_the_longest_class_of_an_earlier_run_goes_first(self):
        with tempfile.TemporaryDirectory() as d:
            for name in ("test_x.py", "test_y.py"):
                pathlib.Path(d, name).write_text("import unittest\nclass C(unittest.TestCase):\n"
                                                 "    def test_it(self):\n        pass\n")
            out = pathlib.Path(d, "times.tsv")
            out.write_text("seconds\ttest\n1.0\ttest_x.C.test_it\n50.0\ttest_y.C.test_it\n")
            r = subprocess.run([sys.executable, str(RUNNER), str(out), "-s", d, "-j", "2"],
                               capture_output=True, text=True, timeout=300)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("2 tests in 2 classes on 2 workers", r.stderr)
        sys.path.insert(0, str(ROOT / "scripts"))
        try:
            import timed_unittest
        finally:
            sys.path.pop(0)
        earlier = {"m.A.t": 3.0, "m.B.t": 9.0}
        groups = [("m.A", ["m.A.t"]), ("m.B", ["m.B.t"])]
        groups.sort(key=lambda g: timed_unittest._weight(g[0], g[1], earlier), reverse=True)
        self.assertEqual([k for k, _ in groups], ["m.B", "m.A"])


if __name__ == "__main__":
    unittest.main()
