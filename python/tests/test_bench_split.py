"""benchmarks.bench_split: its torchtune-style chunked loss is the
Hugging Face loss, and its meta-device comparison runs end to end."""

import types
import unittest

import torch

from benchmarks import bench_split, bench_split_device


def _args(**kw):
    base = dict(meta=True, layers=1, hidden=32, intermediate=64, heads=2, kv_heads=1, vocab=512, tied=True,
                seq=64, batch=2, bf16=False, chunks=None, time_limit=5.0, fit=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


class BenchSplit(unittest.TestCase):
    def test_chunked_ce_is_the_hugging_face_loss(self):
        args = _args(meta=False)
        model = bench_split._model(args)
        b = torch.randint(0, args.vocab, (2, 64), generator=torch.Generator().manual_seed(0))
        hf = bench_split.hf_loss(args)(model, b)
        chunked = bench_split.chunked_ce_loss(args)(model, b)
        torch.testing.assert_close(chunked, hf, rtol=1e-6, atol=1e-6)

    def test_meta_comparison(self):
        out = bench_split.run(_args())
        for side in ("unsplit", "chunked-ce", "split"):
            self.assertGreater(out[side]["arena_bytes"], 0)
            self.assertGreaterEqual(out[side]["max_live_bytes"], out[side]["lower_bound_bytes"])
        self.assertLessEqual(out["split"]["arena_bytes"], out["unsplit"]["arena_bytes"])
        self.assertEqual(out["split"]["split"]["tried"][0]["chunks"], 1)
        self.assertGreaterEqual(out["summary"]["split_below_unsplit"], 0.0)
        self.assertNotIn("fitted", out)

    def test_meta_comparison_with_fits(self):
        # Both fits keep to the share of the unsplit step's FLOPs, the split
        # one counting what its split added, and neither is above its plan.
        out = bench_split.run(_args(fit=0.05))
        for side in ("fitted", "split-fitted"):
            self.assertLessEqual(out[side]["added_share"], 0.05 + 1e-12, side)
            self.assertGreaterEqual(out[side]["max_live_bytes"], out[side]["lower_bound_bytes"])
        self.assertLessEqual(out["fitted"]["arena_bytes"], out["unsplit"]["arena_bytes"])
        self.assertGreaterEqual(out["split-fitted"]["added_flops"], out["split"]["added_flops"])
        s = out["summary"]
        self.assertAlmostEqual(s["split_fitted_below_fitted"],
                               1 - out["split-fitted"]["arena_bytes"] / out["fitted"]["arena_bytes"])


class BenchSplitDevice(unittest.TestCase):
    def test_sides_run_and_agree_on_the_cpu(self):
        """The GPU comparison's sides on the CPU (Liger-Kernel needs CUDA):
        the same losses over the steps, split chunks chosen, every peak
        measured; a side that fails records its error and the rest run."""
        args = _args(meta=False, bf16=False, device="cpu", steps=2, chunks=4,
                     sides="eager,no-such-side,eager-chunked-ce,memplan-split")
        out = bench_split_device.run(args)
        self.assertIn("error", out["no-such-side"])
        for side in ("eager", "eager-chunked-ce", "memplan-split"):
            row = out[side]
            self.assertEqual(len(row["losses"]), 3, side)
            self.assertGreater(row["allocated_bytes"], 0, side)
            self.assertLess(row["loss_difference"], 1e-4, side)
        self.assertEqual(out["memplan-split"]["split"]["chunks"], 4)
        self.assertGreaterEqual(out["memplan-split"]["max_live_bytes"], out["memplan-split"]["lower_bound_bytes"])
        # memplan's measured peak is its plan's (the CPU runs it tensor by
        # tensor) plus AdamW's 0-d float32 step counters, one per parameter,
        # which the plan does not hold.
        params = len(list(bench_split._model(args).parameters()))
        self.assertEqual(out["memplan-split"]["allocated_bytes"], out["memplan-split"]["max_live_bytes"] + 4 * params)


if __name__ == "__main__":
    unittest.main()
