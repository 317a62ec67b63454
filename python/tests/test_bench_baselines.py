"""benchmarks.bench_baselines: eager PyTorch as experts configure it
(optimizer in backward, selective and full activation checkpointing, and
each checkpointing with the optimizer in backward)
measured by the allocator's events beside memplan's plan and fits, on a
tiny Hugging Face Llama (the real models, small)."""

import contextlib
import io
import json
import unittest

from benchmarks import bench_baselines


class BaselinesAsExpertsRunThem(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            bench_baselines.main(["--models", "hf-llama", "--size", "tiny", "--batch", "2", "--seq", "32",
                                  "--cap", "3.2", "--time-limit", "2", "--json"])
        cls.r = json.loads(out.getvalue())["hf-llama"]
        cls.rows = cls.r["rows"]

    def test_every_side_computes_the_same_step(self):
        self.assertEqual(set(self.rows), {*bench_baselines.EAGER_SIDES, "memplan", "memplan-fit-0.1%",
                                          *(f"memplan-fit@{s}" for s in bench_baselines.CHECKPOINTING)})
        self.assertIn("eager-full-ac+optimizer-in-backward", bench_baselines.CHECKPOINTING)
        for side, row in self.rows.items():
            with self.subTest(side=side):
                self.assertEqual(len(row["losses"]), 3)
                self.assertLess(row["loss_difference"], 1e-5)

    def test_the_experts_configurations_hold_less_than_plain_eager(self):
        eager = self.rows["eager"]["peak_bytes"]
        # Freeing each gradient at once pays where the update's moment is the
        # peak; here the peak is the loss's (a few bytes of per-parameter
        # optimizers either way).
        self.assertLessEqual(self.rows["eager-optimizer-in-backward"]["peak_bytes"], eager * 1.001)
        for side in bench_baselines.CHECKPOINTING:
            self.assertLess(self.rows[side]["peak_bytes"], eager, side)
            self.assertGreater(self.rows[side]["added_ops"], 0, side)
        # Full checkpointing runs the matrix products again; the selective
        # policy keeps their outputs and runs only the cheap ops again.
        self.assertGreater(self.rows["eager-full-ac"]["added_flops_share"], 0.1)
        self.assertEqual(self.rows["eager-selective-ac"]["added_flops_share"], 0.0)
        # With the optimizer in the backward pass too (torchtune's recipes):
        # the same recomputation, and no gradient held until the update.
        for ac in ("eager-selective-ac", "eager-full-ac"):
            both = self.rows[f"{ac}+optimizer-in-backward"]
            self.assertEqual(both["flops"], self.rows[ac]["flops"], ac)
            self.assertLessEqual(both["peak_bytes"], self.rows[ac]["peak_bytes"] * 1.001, ac)
        self.assertIn(self.r["best_eager"], bench_baselines.EAGER_SIDES)
        best = min(self.rows[s]["peak_bytes"] for s in bench_baselines.EAGER_SIDES)
        self.assertEqual(self.rows[self.r["best_eager"]]["peak_bytes"], best)

    def test_memplans_sides(self):
        plan = self.rows["memplan"]
        self.assertLessEqual(plan["peak_bytes"], self.rows["eager"]["peak_bytes"])
        self.assertLessEqual(plan["lower_bound_bytes"], plan["max_live_bytes"])
        fit = self.rows["memplan-fit-0.1%"]
        self.assertLessEqual(fit["cost_model_added_share"], 0.001)
        # Counted as the checkpointing sides are (matrix products and
        # attention the captured graph records for the ops run again).
        self.assertGreaterEqual(fit["added_flops_share"], 0.0)
        self.assertLess(fit["added_flops_share"], 0.01)
        self.assertLessEqual(self.rows["memplan-fit-0.1%"]["max_live_bytes"], plan["max_live_bytes"])
        # Fitted to each checkpointing side's measured peak: within it (by
        # plan), or refused with the reason.
        for side in bench_baselines.CHECKPOINTING:
            row = self.rows[f"memplan-fit@{side}"]
            if "error" not in row:
                self.assertLessEqual(row["max_live_bytes"], self.rows[side]["peak_bytes"])
            else:
                self.assertRegex(row["error"], "budget|fit")

    def test_largest_batch_within_a_cap(self):
        lb = self.r["largest_batch"]
        self.assertEqual(lb["cap_bytes"], int(3.2 * 2 ** 20))
        self.assertGreaterEqual(lb["eager"], 1)
        for side in bench_baselines.EAGER_SIDES:
            self.assertGreaterEqual(lb[side], 0, side)
        self.assertGreaterEqual(lb["memplan"], lb["eager"])
        self.assertGreaterEqual(lb["memplan-fit-0.1%"], lb["memplan"])


if __name__ == "__main__":
    unittest.main()


class EachSideInItsOwnProcess(unittest.TestCase):
    """benchmarks.bench_baselines_device (the GPU bench) on the CPU: each
    side in a child process with its allocator configuration, the same
    losses on every side, memplan's arena step beside eager's."""

    def test_sides_in_child_processes(self):
        from benchmarks import bench_baselines_device as dev

        base = dict(model="hf-llama", size="tiny", batch=2, seq=16, steps=2, time_limit=2.0, device="cpu")
        eager = dev.spawn(dict(base, side="eager"), dev.EXPANDABLE, timeout=300)
        mine = dev.spawn(dict(base, side="memplan-fit-0.1%"), timeout=300)
        for r in (eager, mine):
            self.assertNotIn("error", r)
            self.assertGreaterEqual(len(r["losses"]), 3)  # (the CPU's peak costs one step more)
            self.assertGreater(r["allocated_bytes"], 0)
        self.assertEqual(eager["losses"], mine["losses"])
        # FLOPs as the checkpointing sides count them (the captured graph's
        # products and attention), the cost model's share beside.
        self.assertGreaterEqual(mine["added_flops_share"], 0.0)
        self.assertLessEqual(mine["cost_model_added_share"], 0.001)
        self.assertLessEqual(mine["lower_bound_bytes"], mine["max_live_bytes"])
        self.assertGreaterEqual(mine["planned_arena_bytes"], mine["max_live_bytes"])
        # A side that fails reports why, naming the error.
        bad = dev.spawn(dict(base, side="memplan-fit@eager-full-ac", budget=1), timeout=300)
        self.assertIn("fits in", bad["error"])

    def test_memplans_largest_batch_under_a_cap(self):
        """The cap search's logic, run on the CPU (no out-of-memory there:
        the planned batch is the answer): the plans' arena plus what the
        step allocates outside it, grown linearly from batches 1 and 2,
        within the cap; the batch after it not."""
        import torch

        from benchmarks import bench_baselines_device as dev
        from benchmarks.baselines import model_configs

        make = model_configs("tiny")["hf-llama"]
        spec = dict(model="hf-llama", size="tiny", side="memplan", seq=16, steps=2, time_limit=2.0, device="cpu", upto=8,
                    cap_bytes=1_700_000)
        r = dev._largest_memplan(spec, make, torch.device("cpu"), make.vocab_size)
        b = r["largest_batch"]
        self.assertTrue(0 < b < 8, r)
        self.assertEqual(b, r["planned_batch"])
        need = r["planned_arena_bytes"] + r["outside_arena_bytes"] + r["outside_arena_growth_per_sample"] * (b - 1)
        self.assertLessEqual(need, spec["cap_bytes"], r)
        self.assertGreater(r["tokens_per_second"], 0)
        # Every batch the search planned, with its arena; the next batch's
        # plan is past the cap (the search stopped there).
        by_batch = r["planned_arena_by_batch"]
        self.assertEqual(by_batch[b], r["planned_arena_bytes"])
        self.assertIn(b + 1, by_batch)
        after = by_batch[b + 1] + r["outside_arena_bytes"] + r["outside_arena_growth_per_sample"] * b
        self.assertGreater(after, spec["cap_bytes"], r)
        self.assertEqual(r["out_of_memory"], [])  # (the CPU has no cap)
        # An out-of-memory error is kept with its batch, where it happened
        # and PyTorch's message (which names the refused allocation).
        note = dev._oom_note(3, "the planned step's runs", RuntimeError("CUDA out of memory. Tried to allocate\n2.00 GiB."))
        self.assertEqual((note["batch"], note["where"]), (3, "the planned step's runs"))
        self.assertEqual(note["message"], "CUDA out of memory. Tried to allocate 2.00 GiB.")

    def test_bf16_autocast_on_every_side(self):
        """--bf16: every side's loss under bf16 autocast (mixed precision as
        Hugging Face's Trainer runs it), so eager and memplan take the same
        bf16 steps; not the f32 step's losses."""
        from benchmarks import bench_baselines_device as dev

        base = dict(model="hf-llama", size="tiny", batch=2, seq=16, steps=2, time_limit=2.0, device="cpu")
        f32 = dev.spawn(dict(base, side="eager"), timeout=300)
        eager = dev.spawn(dict(base, side="eager-optimizer-in-backward", bf16=True), dev.EXPANDABLE, timeout=300)
        mine = dev.spawn(dict(base, side="memplan", bf16=True), timeout=300)
        for r in (f32, eager, mine):
            self.assertNotIn("error", r)
        self.assertEqual(eager["losses"], mine["losses"])
        self.assertNotEqual(eager["losses"], f32["losses"])
