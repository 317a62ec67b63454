"""tools/limits_bench.py on small sizes, with the binary `cargo test` built."""

import json
import pathlib
import tempfile
import unittest
import xml.etree.ElementTree as ET

from tools import limits_bench

ROOT = pathlib.Path(__file__).resolve().parents[1]


def binary():
    for profile in ("debug", "release"):
        b = ROOT / "target" / profile / "memplan"
        if b.is_file():
            return str(b)
    raise unittest.SkipTest("no memplan binary: run cargo build first")


class LimitsBench(unittest.TestCase):
    def test_crowded_matches_the_rust_bench(self):
        # benches/pipeline.rs's crowded(n): buffers 0 and 1 of n = 1000
        # as the Rust definition makes them.
        with tempfile.TemporaryDirectory() as d:
            p = pathlib.Path(d) / "c.csv"
            limits_bench.crowded_csv(1000, p)
            rows = p.read_text().splitlines()
        self.assertEqual(rows[0], "id,lower,upper,size")
        self.assertEqual(len(rows), 1001)
        for row in rows[1:]:
            i, lower, upper, size = map(int, row.split(","))
            self.assertLess(lower, upper)
            self.assertLessEqual(upper, 2000)
            self.assertLessEqual(upper - lower, 2000 // 25)
            self.assertEqual(size % 64, 0)
            self.assertTrue(64 <= size <= 64 * 256)
        self.assertEqual(rows[1:3], CROWDED_1000_FIRST_ROWS)

    def test_measures_writes_and_plots(self):
        with tempfile.TemporaryDirectory() as d:
            j, s = pathlib.Path(d) / "l.json", pathlib.Path(d) / "l.svg"
            rows = limits_bench.main(["--memplan", binary(), "--layers", "1", "3", "--rows", "300",
                                      "--time-limit", "1", "--json", str(j), "--svg", str(s)])
            record = json.loads(j.read_text())
            svg = ET.parse(s).getroot()
        self.assertEqual(record["runs"], rows)
        self.assertEqual([r["command"] for r in rows], ["plan", "plan", "alloc"])
        plan1, plan3, alloc = rows
        self.assertLess(plan1["size"], plan3["size"])
        self.assertEqual(alloc["size"], 300)
        for r in rows:
            self.assertGreaterEqual(r["wall_seconds"], 0)  # /usr/bin/time counts hundredths
            self.assertGreater(r["peak_rss_bytes"], 1 << 20)
            self.assertGreaterEqual(r["arena_bytes"], r["max_live_bytes"])
        # A line per command in each of the two panels.
        lines = svg.findall("{http://www.w3.org/2000/svg}polyline")
        self.assertEqual(len(lines), 4)
        self.assertIn("alloc", limits_bench.markdown(rows, 1.0))

    def test_bad_arguments_are_refused(self):
        for argv in (["--time-limit", "0"], ["--layers", "0"], ["--layers", "--rows"]):
            with self.subTest(argv=argv), self.assertRaises(SystemExit):
                limits_bench.main(["--memplan", "memplan", *argv])


# Printed by benches/pipeline.rs's `crowded` (its closure, compiled alone).
CROWDED_1000_FIRST_ROWS = ["0,1473,1493,1152", "1,1150,1153,1216"]

if __name__ == "__main__":
    unittest.main()
