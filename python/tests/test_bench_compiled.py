"""benchmarks.bench_compiled: memplan's planned step with Inductor's
kernels beside eager, torch.compile and memplan's eager kernels, on a tiny
Hugging Face Llama (the real model, small): every side computes the same
step, and the figures the table prints are there and consistent."""

import json
import pathlib
import tempfile
import unittest

from benchmarks import bench_compiled


class CompiledSides(unittest.TestCase):
    def test_every_side_runs_the_same_step(self):
        # (Without the compile side: compiling a model and its optimizer
        # step takes half a minute even this small; test_torch's
        # AgainstTorchCompile runs torch.compile's step.)
        sides = "eager,memplan,memplan-fit-0.1%-inductor"
        with tempfile.TemporaryDirectory() as d:
            out = pathlib.Path(d) / "out.json"
            bench_compiled.main(["--models", "hf-llama", "--llama-layers", "2", "--hidden", "64", "--vocab", "256",
                                 "--seq", "32", "--batch", "2", "--steps", "2", "--time-limit", "2", "--sides",
                                 sides, "--json", str(out)])
            r = json.loads(out.read_text())["hf-llama"]
        self.assertEqual(list(r), sides.split(","))
        for side, row in r.items():
            self.assertEqual(len(row["losses"]), 4, side)  # two warm-up steps, two timed
            self.assertGreater(row["step_seconds"], 0, side)
            self.assertGreater(row["peak_bytes"], 0, side)
        self.assertEqual(r["memplan"]["loss_difference"], 0.0)  # aten's kernels: eager's bits
        # Compiled kernels round differently, within float32's rounding.
        self.assertLess(r["memplan-fit-0.1%-inductor"]["loss_difference"], 1e-4)
        fused = r["memplan-fit-0.1%-inductor"]
        self.assertGreater(fused["regions"], 0)
        self.assertEqual(fused["compiled_regions"], fused["regions"])
        self.assertLessEqual(fused["added_flops_share"], 0.001)
        # Fusing never raises the plan's max live (docs/compiled.md).
        self.assertLessEqual(fused["fused_max_live_bytes"], fused["max_live_bytes"])
        self.assertLessEqual(r["memplan"]["lower_bound_bytes"], r["memplan"]["max_live_bytes"])

    def test_the_largest_batch_within_a_cap(self):
        """--cap: each side's largest batch whose measured peak is within
        the cap (the next batch's is not), with its tokens per second."""
        cap = 2.5 * 2 ** 20
        with tempfile.TemporaryDirectory() as d:
            out = pathlib.Path(d) / "out.json"
            bench_compiled.main(["--models", "hf-llama", "--llama-layers", "2", "--hidden", "64", "--vocab", "256",
                                 "--seq", "32", "--steps", "2", "--time-limit", "2", "--sides", "eager,memplan",
                                 "--cap", "2.5", "--upto", "8", "--json", str(out)])
            r = json.loads(out.read_text())["hf-llama"]
        for side, row in r.items():
            b = row["largest_batch"]
            peaks = {int(k): v for k, v in row["peaks_by_batch"].items()}
            self.assertTrue(0 < b < 8, (side, row))
            self.assertLessEqual(peaks[b], cap, side)
            self.assertGreater(peaks[b + 1], cap, side)  # (the search ends between a fit and a miss)
            self.assertEqual(row["peak_bytes"], peaks[b])
            self.assertAlmostEqual(row["tokens_per_second"], b * 32 / row["step_seconds"])


if __name__ == "__main__":
    unittest.main()
