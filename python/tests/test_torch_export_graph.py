"""The torch-free graph writer: file form, checks, liveness."""

import os
import tempfile
import unittest

from memplan.torch.export import graph


def tiny():
    """w (param, 100 B) and x (input, 40 B); y = f(x, w) 60 B; v = view(y);
    z = g(v) 10 B; update w in place from z. Program order max live:
    step 0: w + x + y = 200; step 1 (view): w + y = 160 (x died at 0);
    step 2: w + y + z = 170; step 3: w + z = 110 (+ loss persistent)."""
    b = graph.GraphBuilder("tiny")
    w = b.add_tensor("w", 100, role="parameter", lifetime="persistent")
    x = b.add_tensor("x", 40, role="input")
    y = b.add_tensor("y", 60)
    v = b.add_tensor("v", 0, view_of=y)
    z = b.add_tensor("z", 10, role="output", lifetime="persistent")
    b.add_op("f", "forward", "aten.mm.default", inputs=[x, w], outputs=[y])
    b.add_op("view", "forward", "aten.view.default", inputs=[y], outputs=[v])
    b.add_op("g", "forward", "aten.sum.default", inputs=[v], outputs=[z])
    b.add_op("upd", "optimizer", "aten.add_.Tensor", inputs=[z], updates=[w])
    return b


class GraphTest(unittest.TestCase):
    def test_file_form_refers_by_id(self):
        d = tiny().to_dict()
        self.assertEqual(d["format"], "memplan-graph")
        self.assertEqual(d["version"], 1)
        v = [t for t in d["tensors"] if t["id"] == "v"][0]
        self.assertEqual(v["view_of"], "y")
        upd = d["ops"][3]
        self.assertEqual(upd["updates"], ["w"])
        self.assertEqual(upd["inputs"], ["z"])
        self.assertNotIn("outputs", upd)
        graph.check(d)

    def test_program_order_live(self):
        live = graph.program_order_live(tiny().to_dict())
        self.assertEqual(live["max_live"], 200)
        self.assertEqual(live["peak_step"], 0)
        # y dies at g (its view is read there), x at f, w and z live to the end.
        self.assertEqual(live["death"]["y"], 2)
        self.assertEqual(live["death"]["x"], 0)
        self.assertEqual(live["death"]["w"], 3)
        self.assertEqual(live["birth"]["z"], 2)
        self.assertEqual(live["death"]["z"], 3)
        self.assertNotIn("v", live["birth"])

    def test_write_and_load_gzip_is_deterministic(self):
        with tempfile.TemporaryDirectory() as tmp:
            a, b = os.path.join(tmp, "a.json.gz"), os.path.join(tmp, "b.json.gz")
            tiny().write(a)
            tiny().write(b)
            with open(a, "rb") as fa, open(b, "rb") as fb:
                da, db = fa.read(), fb.read()
            self.assertEqual(da[:2], b"\x1f\x8b")
            self.assertEqual(da, db)
            self.assertEqual(graph.load(a), tiny().to_dict())
            plain = os.path.join(tmp, "p.json")
            tiny().write(plain)
            self.assertEqual(graph.load(plain), tiny().to_dict())

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
        b = graph.GraphBuilder("bad")
        a = b.add_tensor("a", 4)
        c = b.add_tensor("c", 4)
        b.add_op("reads_unmade", "forward", "f", inputs=[a], outputs=[c])
        with self.assertRaisesRegex(graph.GraphError, "'reads_unmade' reads 'a'"):
            graph.check(b.to_dict())

        b = graph.GraphBuilder("bad")
        a = b.add_tensor("a", 4)
        b.add_op("p1", "forward", "f", outputs=[a])
        b.add_op("p2", "forward", "f", outputs=[a])
        with self.assertRaisesRegex(graph.GraphError, "produced by 'p1' and 'p2'"):
            graph.check(b.to_dict())

        b = graph.GraphBuilder("bad")
        a = b.add_tensor("a", 4)
        b.add_op("self", "forward", "f", outputs=[a], updates=[a])
        with self.assertRaisesRegex(graph.GraphError, "'self' updates its own output"):
            graph.check(b.to_dict())

        b = graph.GraphBuilder("bad")
        a = b.add_tensor("a", 4, role="input")
        c = b.add_tensor("c", 4)
        b.add_op("early", "forward", "f", inputs=[c])
        b.add_op("late", "forward", "f", inputs=[a], outputs=[c])
        with self.assertRaisesRegex(graph.GraphError, "before its producer"):
            graph.check(b.to_dict())

    def test_reuse_hints(self):
        b = graph.GraphBuilder("r")
        x = b.add_tensor("x", 64, role="input")
        y = b.add_tensor("y", 64)
        big = b.add_tensor("big", 128)
        b.add_op("relu", "forward", "aten.relu.default", inputs=[x], outputs=[y], reuse=[(y, x)])
        d = b.to_dict()
        self.assertEqual(d["ops"][0]["reuse"], [{"output": "y", "input": "x"}])
        graph.check(d)
        b.add_op("grow", "forward", "aten.cat.default", inputs=[y], outputs=[big], reuse=[(big, y)])
        with self.assertRaisesRegex(graph.GraphError, "'grow': reuse 'big' <- 'y': the output is larger"):
            graph.check(b.to_dict())

    def test_builder_rejects_unknown_names(self):
        b = graph.GraphBuilder("x")
        with self.assertRaisesRegex(graph.GraphError, "unknown role"):
            b.add_tensor("a", 1, role="weights")
        with self.assertRaisesRegex(graph.GraphError, "unknown kind"):
            b.add_op("o", "fwd", "f")
        with self.assertRaisesRegex(graph.GraphError, "out of range"):
            b.add_tensor("a", -1)


if __name__ == "__main__":
    unittest.main()
