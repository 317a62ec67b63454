"""Offloaded captured steps (issue 58, docs/offload.md): the Rust core
chooses which tensors leave the device and when they come back, and
memplan.torch runs the step with its copies. On the CPU the host pool is a
second set of storages: the tracked device peak must be the plan's max
live, and every value must equal the plain step's to the bit (a copy is a
copy), with optimizers whose results would show any difference (SGD,
AdamW's moments)."""

import unittest

import torch

import memplan
import memplan.torch
from memplan.torch import UnsupportedStep, _offload

CPU = {"device": "cpu-dev"}


def causal_lm(m, b):
    return m(input_ids=b, labels=b).loss


def llama(optimizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    return model, opt


BATCHES = [torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(3)]


class OffloadedSteps(unittest.TestCase):
    def assert_same_as_plain(self, plain, offloaded, models, optimizers):
        # The step with its copies passes the independent checker, which
        # reports the host pool beside the device.
        check = memplan.check(offloaded.graph, offloaded.plan)
        self.assertEqual(check["max_live_bytes"], offloaded.plan["stats"]["max_live_bytes"])
        self.assertGreater(check["host_max_live_bytes"], 0)
        for b in BATCHES:
            la, lb = plain(b, track=True), offloaded(b, track=True)
            self.assertEqual(la.item(), lb.item())
            # The device's live bytes are the plan's: the host pool is not counted.
            self.assertEqual(offloaded.tracked_peak_bytes, offloaded.plan["stats"]["max_live_bytes"],
                             offloaded.tracked_peak_contents[:5])
        (ma, mb), (oa, ob) = models, optimizers
        for (name, p), q in zip(ma.named_parameters(), mb.parameters()):
            self.assertTrue(torch.equal(p, q), name)
            for key, value in oa.state[p].items():
                self.assertTrue(torch.equal(value, ob.state[q][key]), f"{name}: {key}")

    def test_within_a_slowdown_an_llama_step_runs_in_less_device_memory_with_the_plain_steps_values(self):
        for optimizer in ("adamw", "sgd"):
            with self.subTest(optimizer=optimizer):
                ma, oa = llama(optimizer)
                mb, ob = llama(optimizer)
                plain = memplan.torch.capture(ma, oa, BATCHES[0], causal_lm)
                offloaded = memplan.torch.capture(mb, ob, BATCHES[0], causal_lm)
                report = offloaded.fit(offload=CPU, max_slowdown=0.5, time_limit=5)
                figures = report["offload"]
                self.assertGreater(figures["offloaded_tensors"], 0)
                self.assertGreater(figures["host_bytes"], 0)
                self.assertLessEqual(figures["modeled_seconds"], figures["modeled_seconds_without_offload"] * 1.5)
                self.assertLess(offloaded.plan["arena_bytes"], 0.8 * plain.plan["arena_bytes"])
                self.assert_same_as_plain(plain, offloaded, (ma, mb), (oa, ob))

    def test_capture_fits_a_budget_with_offload(self):
        ma, oa = llama("sgd")
        mb, ob = llama("sgd")
        plain = memplan.torch.capture(ma, oa, BATCHES[0], causal_lm)
        budget = plain.plan["arena_bytes"] * 85 // 100
        offloaded = memplan.torch.capture(mb, ob, BATCHES[0], causal_lm, budget=budget, offload=CPU, time_limit=5)
        self.assertLessEqual(offloaded.fitted["arena_bytes"], budget)
        self.assertGreater(offloaded.fitted["offload"]["offloaded_tensors"], 0)
        self.assertTrue(_offload.host_tensors(offloaded.graph))
        self.assert_same_as_plain(plain, offloaded, (ma, mb), (oa, ob))

    def test_what_is_not_run_yet_is_refused_by_name(self):
        m, o = llama("sgd")
        step = memplan.torch.capture(m, o, BATCHES[0], causal_lm)
        step.fit(offload=CPU, max_slowdown=0.5, time_limit=5)
        with self.assertRaisesRegex(UnsupportedStep, "outside the arena"):
            step(BATCHES[0], arena=True)
        with self.assertRaisesRegex(UnsupportedStep, "CPU only"):
            _offload.refuse("cuda", None, None)
        with self.assertRaisesRegex(UnsupportedStep, "data-parallel or sharded"):
            _offload.refuse("cpu", object(), None)
        with self.assertRaisesRegex(UnsupportedStep, "split step"):
            _offload.refuse("cpu", None, {"chunks": 4})
        with self.assertRaisesRegex(TypeError, "offload goes with budget"):
            memplan.torch.capture(m, o, BATCHES[0], causal_lm, offload=True)
        with self.assertRaisesRegex(TypeError, "unknown"):
            step.fit(offload={"devcie": "cpu-dev"}, max_slowdown=0.5)
        with self.assertRaisesRegex(memplan.MemplanError, "does not fit|no offload found|bound"):
            step.fit(1024, offload=CPU, time_limit=2)


if __name__ == "__main__":
    unittest.main()
