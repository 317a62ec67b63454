"""memplan.torch.estimate: one rank's memory for a training configuration,
captured on the meta device under PyTorch's fake process group
(docs/estimate.md). Its figures against real gloo runs are in
test_torch_distributed (DataParallelBench)."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

import memplan
import memplan.torch as mt

TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 170,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 64, "tie_word_embeddings": False}


class EstimateRefusesWhatCannotBe(unittest.TestCase):
    """Refusals come before anything is made: each names the setting."""

    def refused(self, pattern, **kw):
        kw.setdefault("config", TINY)
        with self.assertRaisesRegex(memplan.MemplanError, pattern):
            mt.estimate(**kw)

    def test_impossible_meshes(self):
        self.refused(r"2 attention heads do not divide over tp 4", world=4, tp=4)
        self.refused(r"1 key/value heads do not divide over tp 2", world=2, tp=2)
        self.refused(r"dp_shard 4 x tp 1 is 8 ranks.*larger than the world", world=4, dp_shard=4,
                     dp_replicate=2)
        self.refused(r"world 6 is not a multiple of dp_replicate x tp = 4", world=6, dp_replicate=4)
        self.refused(r"give the world size", dp_shard=None)
        self.refused(r"micro_batch: 0 is not a whole number", world=2, micro_batch=0)

    def test_what_memplan_does_not_capture(self):
        self.refused(r"pp 2: pipeline parallelism is not captured", world=2, pp=2)
        self.refused(r"ep 2: expert parallelism", world=2, ep=2)
        self.refused(r"tp 2: tensor parallelism .* not captured by memplan yet",
                     config=dict(TINY, num_key_value_heads=2), world=2, tp=2)
        moe = {"model_type": "mixtral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "num_local_experts": 4}
        self.refused(r"a mixture of 4 experts", config=moe, world=2)

    def test_bad_settings_and_sources(self):
        self.refused(r"ac: 'some' is not one of", world=2, ac="some")
        self.refused(r"optimizer: 'lion'", world=2, optimizer="lion")
        self.refused(r"give one model: .*got config, torchtitan", world=2, torchtitan="debugmodel")
        self.refused(r"torchtitan flavor 'huge': llama3's flavors are", config=None, torchtitan="huge", world=2)
        self.refused(r"a Hugging Face config has a 'model_type'", config={"hidden_size": 4}, world=2)
        self.refused(r"config .*missing.json: cannot read it", config="/nonexistent/missing.json", world=2)
        self.refused(r"device_memory", world=2, device_memory="lots")


class EstimateOfATinyLlama(unittest.TestCase):
    def test_rows_are_ordered_as_they_must_be(self):
        r = mt.estimate(TINY, world=4, dp_replicate=2, seq=32, accumulate=2, ac="selective", time_limit=2,
                        device_memory="8MiB")
        rows = r["rows"]
        c = r["configuration"]
        self.assertEqual((c["dp_replicate"], c["dp_shard"], c["world"]), (2, 2, 4))
        self.assertGreater(r["ops"], 1000)  # two micro-batches' forward and backward, the updates
        self.assertLessEqual(rows["lower-bound"], rows["memplan-plan"])
        self.assertLessEqual(rows["memplan-plan"], rows["memplan-plan-arena"])
        self.assertLessEqual(rows["memplan-fit-0.1%"], rows["memplan-plan"])
        self.assertLessEqual(rows["fsdp2-eager-allocated"], rows["fsdp2-eager-default"])
        self.assertLessEqual(rows["memplan-plan"], rows["fsdp2-eager-allocated"])
        self.assertLessEqual(r["fit_added_flops_share"], 0.001)
        m = r["max_micro_batch"]
        self.assertEqual(m["budget_bytes"], 8 << 20)
        self.assertGreaterEqual(m["planned"], m["eager"])
        self.assertGreaterEqual(m["fitted"], m["planned"])
        # The micro-batch it names for the plan is one whose step is planned within the budget.
        at = mt.estimate(TINY, world=4, dp_replicate=2, seq=32, accumulate=2, ac="selective", time_limit=2,
                         micro_batch=m["planned"])
        self.assertLessEqual(at["rows"]["memplan-plan-arena"], m["budget_bytes"])
        self.assertIn("largest micro-batch in 8 MiB", mt._estimate.table(r))

    def test_the_plan_is_never_above_fsdp2_eagers_order(self):
        # torchtitan's 70B shape, 8 of its blocks, full AC, 64 ranks: the
        # solver's orders held 20.1 GiB where FSDP2 eager's holds 16.9
        # (2026-12-03); FSDP2 eager's order is now a candidate of the plan.
        r = mt.estimate(torchtitan="70B", layers=8, world=64, seq=8192, ac="full", time_limit=10)
        rows = r["rows"]
        self.assertLessEqual(rows["memplan-plan"], rows["fsdp2-eager-allocated"])
        self.assertLessEqual(rows["lower-bound"], rows["memplan-plan"])

    def test_the_command_line_prints_the_table_and_json(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(TINY, f)
            cmd = [sys.executable, "-m", "memplan.torch.estimate", "--config", d, "--world", "2", "--seq", "32",
                   "--time-limit", "2"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            self.assertEqual(out.returncode, 0, out.stderr[-3000:])
            self.assertIn("llama (2 layers x 64) on 2 ranks (dp_shard 2), seq 32", out.stdout)
            self.assertIn("memplan's plan (its tensors)", out.stdout)
            out = subprocess.run(cmd + ["--json", "--layers", "1"], capture_output=True, text=True, timeout=300)
            self.assertEqual(out.returncode, 0, out.stderr[-3000:])
            self.assertEqual(json.loads(out.stdout)["configuration"]["model"], "llama (1 layers x 64)")
            out = subprocess.run(cmd[:-2] + ["--pp", "2"], capture_output=True, text=True, timeout=300)
            self.assertEqual(out.returncode, 1)
            self.assertIn("memplan estimate: pp 2: pipeline parallelism", out.stderr)


if __name__ == "__main__":
    unittest.main()
