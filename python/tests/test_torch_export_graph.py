"""Graph files (torch-free): writing, reading, and checking through
memplan's core, which names the element it rejects."""

import copy
import os
import tempfile
import unittest

import memplan
from memplan.torch.export import graph


def tiny():
    """w (param, 100 B) and x (input, 40 B); y = f(x, w) 60 B; v = view(y);
    z = g(v) 10 B; update w in place from z. Program order max live:
    step 0: w + x + y = 200; step 1 (view): w + y = 160 (x died at 0);
    step 2: w + y + z = 170; step 3: w + z = 110 (+ loss persistent)."""
    t = [{"id": "w", "size": 100, "role": "parameter", "lifetime": "persistent"},
         {"id": "x", "size": 40, "role": "input", "lifetime": "transient"},
         {"id": "y", "size": 60, "role": "activation", "lifetime": "transient"},
         {"id": "v", "size": 0, "role": "activation", "lifetime": "transient", "view_of": "y"},
         {"id": "z", "size": 10, "role": "output", "lifetime": "persistent"}]
    ops = [{"id": "f", "kind": "forward", "type": "aten.mm.default", "inputs": ["x", "w"], "outputs": ["y"]},
           {"id": "view", "kind": "forward", "type": "aten.view.default", "inputs": ["y"], "outputs": ["v"]},
           {"id": "g", "kind": "forward", "type": "aten.sum.default", "inputs": ["v"], "outputs": ["z"]},
           {"id": "upd", "kind": "optimizer", "type": "aten.add_.Tensor", "inputs": ["z"], "updates": ["w"]}]
    return {"format": "memplan-graph", "version": 1, "name": "tiny", "tensors": t, "ops": ops}


class GraphTest(unittest.TestCase):
    def test_program_order_max_live_is_the_cores(self):
        self.assertEqual(graph.program_order_max_live(tiny()), 200)
        self.assertEqual(graph.check(tiny())["program-order"]["peak_bytes"], 200)

    def test_write_and_load_gzip_is_deterministic(self):
        with tempfile.TemporaryDirectory() as tmp:
            a, b = os.path.join(tmp, "a.json.gz"), os.path.join(tmp, "b.json.gz")
            graph.write(tiny(), a)
            graph.write(tiny(), b)
            with open(a, "rb") as fa, open(b, "rb") as fb:
                da, db = fa.read(), fb.read()
            self.assertEqual(da[:2], b"\x1f\x8b")
            self.assertEqual(da, db)
            self.assertEqual(graph.load(a), tiny())
            plain = os.path.join(tmp, "p.json")
            graph.write(tiny(), plain)
            self.assertEqual(graph.load(plain), tiny())

    def test_load_rejects_other_files(self):
        with tempfile.TemporaryDirectory() as tmp:
            p = os.path.join(tmp, "x.json")
            with open(p, "w") as f:
                f.write('{"format": "something", "version": 1}')
            with self.assertRaisesRegex(graph.GraphError, "not a memplan-graph"):
                graph.load(p)
            with open(p, "w") as f:
                f.write("{")
            with self.assertRaisesRegex(graph.GraphError, "not JSON"):
                graph.load(p)

    def test_check_names_the_bad_element(self):
        def broken(edit):
            d = copy.deepcopy(tiny())
            edit(d)
            with self.assertRaises(memplan.MemplanError) as e:
                graph.check(d)
            return str(e.exception)

        def two_producers(d):
            d["ops"][2]["outputs"] = ["y"]

        def reads_later_output(d):
            d["ops"][0]["inputs"] = ["z", "w"]

        def self_update(d):
            d["ops"][2]["updates"] = ["z"]

        def unknown(d):
            d["ops"][1]["inputs"] = ["nope"]

        self.assertIn('tensor "y" is produced by two ops, "f" and "g"', broken(two_producers))
        self.assertIn("cycle: g -> f -> g", broken(reads_later_output))
        self.assertIn('"g"', broken(self_update))
        self.assertIn('op "view": inputs names unknown tensor "nope"', broken(unknown))

    def test_reuse_hints_are_checked(self):
        d = tiny()
        d["ops"][0]["reuse"] = [{"output": "y", "input": "x"}]
        with self.assertRaises(memplan.MemplanError) as e:
            graph.check(d)  # y (60 B) is larger than x (40 B)
        self.assertIn('op "f": reuse hint "y" <- "x": the output is larger than the input', str(e.exception))


if __name__ == "__main__":
    unittest.main()
