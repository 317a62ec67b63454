"""XLA runs memplan's order: tools/xla_run_scheduled.py on four committed
optimized modules (the MLP and GPT-2 tiny training steps, and two sharded
steps run on 8 CPU devices: an MLP on a 2x4 mesh and a decoder under
FSDP). XLA's CPU compiler must keep the relisted entry order, the outputs
must equal the original module's bit for bit, and XLA's own memory report
for memplan's order must not be above its report for its own order (below
it, except on the decoder, where XLA's order is within 0.11% of the
bound) and within the recorded packing overhead of memplan's prediction
(docs/hlo.md). By XLA's own buffer assignment and live ranges, the bytes
XLA's live values cover at its busiest instruction must be memplan's
prediction (or up to 0.5% less), and the rest of XLA's total must be bytes
of its allocations no value covers there.

Needs jax[cpu], pypjrt and lammps-jax-pjrt-cpu in .venv (scripts/
python_tests.sh installs them) and a memplan binary (cargo test builds
target/debug/memplan; MEMPLAN_BIN names another)."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def memplan_binary():
    if os.environ.get("MEMPLAN_BIN"):
        return os.environ["MEMPLAN_BIN"]
    found = [p for p in (os.path.join(ROOT, "target", k, "memplan") for k in ("debug", "release"))
             if os.path.exists(p)]
    if not found:
        raise RuntimeError("no memplan binary: run `cargo build --bin memplan` (or set MEMPLAN_BIN)")
    return max(found, key=os.path.getmtime)


class XlaRunsMemplansOrder(unittest.TestCase):
    def run_module(self, name, *extra):
        module = os.path.join(ROOT, "fixtures", "hlo", name, "cpu_after_optimizations.txt.gz")
        with tempfile.TemporaryDirectory() as work:
            res = subprocess.run(
                [sys.executable, os.path.join(ROOT, "tools", "xla_run_scheduled.py"), module,
                 "--memplan", memplan_binary(), "--work", work, "--json", "--time-limit", "5",
                 *extra],
                capture_output=True, text=True, cwd=ROOT)
            self.assertEqual(res.returncode, 0, res.stderr[-3000:] + res.stdout[-2000:])
            return json.loads(res.stdout)

    def check_order_and_results(self, name, overhead):
        r = self.run_module(name)
        self.assertTrue(r["xla_kept_memplan_order"], r)
        self.assertTrue(r["outputs_bitwise_equal"], r)
        self.assertLessEqual(r["xla_total_bytes_memplan_order"], r["xla_total_bytes_original"], r)
        # XLA places memplan's order with its own heap simulator: its total
        # is at least the plan's max live, and above it only by packing.
        self.assertGreaterEqual(r["xla_total_bytes_memplan_order"], r["memplan_max_live_bytes"], r)
        self.assertLessEqual(r["xla_memplan_order_vs_prediction"], overhead, r)
        # By XLA's own buffer assignment and live ranges, the bytes its live
        # values cover at its busiest instruction are memplan's prediction
        # (XLA shares a little more on some modules: at most 0.4% below);
        # the rest of XLA's total is bytes of its allocations that no value
        # covers there.
        self.assertLessEqual(r["xla_live_bytes_memplan_order"], r["memplan_max_live_bytes"], r)
        self.assertGreaterEqual(r["xla_live_vs_max_live"], 0.995, r)
        self.assertEqual(r["xla_live_bytes_memplan_order"] + r["xla_idle_bytes_at_peak"],
                         r["xla_total_bytes_memplan_order"], r)
        return r

    def check(self, name, overhead):
        """As check_order_and_results, and XLA needs strictly less for
        memplan's order than for its own."""
        r = self.check_order_and_results(name, overhead)
        self.assertLess(r["xla_total_bytes_memplan_order"], r["xla_total_bytes_original"], r)
        return r

    def test_mlp(self):
        self.check("mlp", 1.03)

    def test_gpt2_tiny(self):
        r = self.check("xla_gpt2_tiny", 1.10)
        # XLA's 9.8% above the prediction is one idle allocation: the
        # donated lm_head kernel's (f32[128,50257], 25,731,584 bytes), dead
        # after XLA's transposed copy of it; XLA reuses a parameter's
        # allocation only for a value that fits inside it, and none of the
        # values live at the peak does.
        self.assertGreater(r["xla_idle_parameter_bytes_at_peak"], 25_000_000, r)
        self.assertIn("f32[128,50257]", r["xla_largest_idle_allocation"], r)

    def test_xla_allocations_predict_what_xla_needs(self):
        # `memplan plan --xla-allocations`: every aliased parameter's
        # allocation held all step (the plan's max live, a ceiling on XLA's
        # need), and memplan's estimate of XLA's total, which also puts
        # values into dead parameters' allocations as XLA does. Measured:
        # XLA within 0.06% of the estimate on both.
        for name in ("xla_gpt2_tiny", "mlp"):
            r = self.run_module(name, "--xla-allocations")
            self.assertTrue(r["xla_kept_memplan_order"], r)
            self.assertTrue(r["outputs_bitwise_equal"], r)
            self.assertLessEqual(r["xla_total_bytes_memplan_order"], r["xla_total_bytes_original"], r)
            self.assertLessEqual(r["xla_total_bytes_memplan_order"], r["memplan_max_live_bytes"] * 1.001, r)
            self.assertLessEqual(r["xla_memplan_order_vs_prediction"], 1.01, r)
            self.assertGreaterEqual(r["xla_memplan_order_vs_prediction"], 0.99, r)

    def test_sharded_data_and_tensor_parallel(self):
        # one program per rank on 8 CPU devices, all-reduces between them
        r = self.check("spmd_dp2_tp4", 1.01)
        self.assertEqual(r["devices"], 8, r)

    def test_sharded_decoder(self):
        # FSDP-style: 18 all-gathers and an all-reduce per rank, 8 ranks
        r = self.check_order_and_results("spmd_transformer_fsdp8", 1.01)
        self.assertEqual(r["devices"], 8, r)


if __name__ == "__main__":
    unittest.main()
