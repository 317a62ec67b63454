"""The Python package against the Rust core: plans, checks, and errors."""

import copy
import gzip
import json
import os
import pathlib
import tempfile
import unittest

import memplan

ROOT = pathlib.Path(__file__).resolve().parents[2]
GPT2_TINY = ROOT / "fixtures" / "graphs" / "gpt2-tiny.json.gz"

TWO_OPS = {
    "format": "memplan-graph",
    "version": 1,
    "name": "two-ops",
    "tensors": [
        {"id": "x", "size": 1024, "role": "input", "lifetime": "persistent"},
        {"id": "h", "size": 4096},
        {"id": "y", "size": 1024, "role": "output", "lifetime": "persistent"},
    ],
    "ops": [
        {"id": "f", "inputs": ["x"], "outputs": ["h"]},
        {"id": "g", "inputs": ["h"], "outputs": ["y"]},
    ],
}


class PlanAndCheck(unittest.TestCase):
    def test_plans_a_dict_and_the_plan_checks(self):
        p = memplan.plan(TWO_OPS, time_limit=1)
        self.assertEqual(p["order"], ["f", "g"])
        self.assertEqual(p["arena_bytes"], 6144)
        offsets = {t["id"]: t["offset"] for t in p["tensors"]}
        self.assertEqual(set(offsets), {"x", "h", "y"})
        report = memplan.check(TWO_OPS, p)
        self.assertEqual(report["max_live_bytes"], 6144)
        self.assertEqual(report["ops"], 2)

    def test_plans_a_shipped_graph_file_at_its_floor(self):
        p = memplan.plan(GPT2_TINY, time_limit=2)
        stats = p["stats"]
        self.assertLessEqual(stats["lower_bound_bytes"], p["arena_bytes"])
        self.assertLessEqual(p["arena_bytes"], 1.01 * stats["lower_bound_bytes"])
        memplan.check(GPT2_TINY, p)
        # The same graph as a JSON string, from a plain .json file.
        text = gzip.decompress(GPT2_TINY.read_bytes()).decode()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "g.json")
            with open(path, "w") as f:
                f.write(text)
            self.assertEqual(memplan.check(path, p), memplan.check(text, json.dumps(p)))

    def test_a_broken_plan_is_refused_with_the_reason(self):
        p = memplan.plan(TWO_OPS, time_limit=1)
        swapped = copy.deepcopy(p)
        swapped["order"] = ["g", "f"]
        with self.assertRaises(memplan.MemplanError) as e:
            memplan.check(TWO_OPS, swapped)
        self.assertIn("<plan>", str(e.exception))
        small = copy.deepcopy(p)
        small["arena_bytes"] = 1024
        with self.assertRaises(memplan.MemplanError):
            memplan.check(TWO_OPS, small)

    def test_built_in_examples_plan_with_the_cli_spec(self):
        # One rank of a per-parameter FSDP2 step over two ranks.
        g = memplan.example("llama-tiny,world=2,mixed")
        self.assertEqual(g["metadata"]["fsdp_layout"], "per-parameter")
        types = {op["type"] for op in g["ops"]}
        self.assertTrue({"all_gather", "copy_out", "chunk_cat", "reduce_scatter"} <= types, types)
        p = memplan.plan(g, time_limit=2)
        self.assertEqual(memplan.check(g, p)["ops"], len(g["ops"]))
        flat = memplan.example("example:llama-tiny,world=2,mixed,flat")
        self.assertEqual(flat["metadata"]["fsdp_layout"], "flat")
        self.assertLess(len(flat["ops"]), len(g["ops"]))
        with self.assertRaisesRegex(memplan.MemplanError, "unknown example"):
            memplan.example("gpt5")

    def test_bad_input_raises_memplan_error(self):
        bad = copy.deepcopy(TWO_OPS)
        bad["ops"][1]["inputs"] = ["nowhere"]
        with self.assertRaises(memplan.MemplanError) as e:
            memplan.plan(bad)
        self.assertIn("nowhere", str(e.exception))
        with self.assertRaises(memplan.MemplanError):
            memplan.plan(TWO_OPS, time_limit=0)
        with self.assertRaises(memplan.MemplanError) as e:
            memplan.plan("/no/such/graph.json")
        self.assertIn("/no/such/graph.json", str(e.exception))
        with self.assertRaises(TypeError):
            memplan.plan(42)

    def test_bad_arguments_are_memplan_errors_naming_the_element(self):
        # Issue 41: each of these raised TypeError, OverflowError or a bare
        # JSON column before.
        self.assertEqual(memplan._budget("24GiB"), 24 << 30)
        self.assertEqual(memplan._budget("1.5 GB"), 1_500_000_000)
        for bad, says in (("24 parsecs", "unknown unit"), (2 ** 70, "2\\*\\*64"), (-1, "between 0"),
                          (1.5, "number of bytes"), (None, "number of bytes"), ("-3GB", "non-negative")):
            with self.assertRaisesRegex(memplan.MemplanError, says, msg=repr(bad)):
                memplan.fit(TWO_OPS, budget=bad)
        with self.assertRaisesRegex(memplan.MemplanError, "time_limit"):
            memplan.plan(TWO_OPS, time_limit="soon")
        with self.assertRaisesRegex(memplan.MemplanError, "time limit"):
            memplan.plan(TWO_OPS, time_limit=1e300)
        g = json.loads(json.dumps(TWO_OPS))
        g["tensors"][1]["size"] = float("nan")
        with self.assertRaisesRegex(memplan.MemplanError, r"graph\.tensors\[1\]\.size is nan"):
            memplan.plan(g)
        g = json.loads(json.dumps(TWO_OPS))
        g["ops"][0]["flops"] = float("inf")
        with self.assertRaisesRegex(memplan.MemplanError, r"graph\.ops\[0\]\.flops is inf"):
            memplan.fit(g, max_added=0.1)
        # A budget as a string reaches the fit (which then says it cannot fit 1 byte).
        with self.assertRaisesRegex(memplan.MemplanError, "bound|fit"):
            memplan.fit(TWO_OPS, budget="1B", time_limit=1)
        self.assertTrue(issubclass(memplan.MemplanError, ValueError))
        self.assertEqual(memplan.__version__.count("."), 2)


if __name__ == "__main__":
    unittest.main()
