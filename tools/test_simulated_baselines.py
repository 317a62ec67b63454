"""tools/simulated_baselines.py on a tiny GPT-2 captured on the meta device:
the eager configurations simulated on the captured graphs, memplan's plan
and fits beside them (the memplan binary that `cargo test` builds)."""

import os
import unittest

from tools import simulated_baselines as sb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = next((p for p in (os.path.join(ROOT, "target", d, "memplan") for d in ("debug", "release"))
               if os.path.exists(p)), None)


@unittest.skipIf(BINARY is None, "no memplan binary: `cargo build` first")
class SimulatedAgainstTheBestEager(unittest.TestCase):
    def test_tiny_gpt2(self):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            r = sb.measure("gpt2-tiny", BINARY, 2.0, d)
        sides = r["sides"]
        self.assertIn(r["best_eager"], sides)
        best = sides[r["best_eager"]]["peak_bytes"]
        self.assertEqual(best, min(v["peak_bytes"] for k, v in sides.items() if "/" in k))
        # The plan recomputes nothing: never above eager without recomputation.
        plain = min(sides[f"plain/{k}"]["peak_bytes"] for k in sb.EAGER_KEYS)
        self.assertLessEqual(sides["memplan"]["peak_bytes"], plain)
        self.assertLessEqual(sides["memplan"]["lower_bound_bytes"], sides["memplan"]["peak_bytes"])
        self.assertLessEqual(sides["memplan-fit-0.1%"]["cost_model_added_share"], 0.001)
        self.assertGreaterEqual(sides["memplan-fit-0.1%"]["added_flops_share"], 0.0)
        self.assertLessEqual(sides["memplan-fit-0.1%"]["peak_bytes"], sides["memplan"]["peak_bytes"])
        # The loss split (where it lowers the plan) and then fitted: the
        # split's FLOPs and the recomputation's within the same 0.1%.
        split_fit = sides["memplan-split-fit-0.1%"]
        self.assertLessEqual(split_fit["cost_model_added_share"], 0.001 + 1e-12)
        self.assertLessEqual(split_fit["peak_bytes"], sides["memplan"]["peak_bytes"])
        self.assertGreaterEqual(split_fit["chunks"], 1)
        # The floor within the share holds for both fits.
        for row in (sides["memplan-fit-0.1%"], split_fit):
            self.assertLessEqual(row["share_floor_bytes"], row["peak_bytes"])
            self.assertGreater(row["share_floor_bytes"], 0)
        # Full checkpointing runs the forward's products again; the selective
        # policy keeps their outputs.
        self.assertGreater(sides["full-ac/pytorch-reserved"]["added_flops_share"], 0.1)
        self.assertEqual(sides["selective-ac/pytorch-reserved"]["added_flops_share"], 0.0)
        for side in ("selective-ac", "full-ac"):
            row = sides[f"memplan-fit@{side}"]
            if "error" in row:
                self.assertIn("fits in", row["error"])
                continue
            self.assertLessEqual(row["peak_bytes"], row["budget_bytes"])
        # The best eager configuration may be checkpointing with the
        # optimizer in the backward (torchtune's combination).
        self.assertIn("full-ac/eager-optimizer-in-backward-expandable-segments", sides)
        if "error" not in sides["memplan-fit@full-ac"]:
            self.assertLess(sides["memplan-fit@full-ac"]["added_flops_share"],
                            sides["full-ac/pytorch-reserved"]["added_flops_share"])
        self.assertIn("gpt2-tiny", sb.report("gpt2-tiny", r))


if __name__ == "__main__":
    unittest.main()
