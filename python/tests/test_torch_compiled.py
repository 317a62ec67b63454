"""memplan.torch with torch.compile: models with compiled parts are
captured through them (the same step as eager, to the bit), and
``kernels="inductor"`` runs the planned step with regions compiled by
Inductor (docs/compiled.md).

Tolerance for Inductor's kernels against eager: ``rtol=1e-5, atol=1e-6``
on float32 (fused kernels add in another order); the eager-kernel runs
are equal to the bit.
"""

import copy
import unittest
import warnings
from unittest import mock

import torch

import memplan
import memplan.torch as mt
from memplan.torch import _fused
from memplan.torch._run import allocator_peak

INDUCTOR_TOL = dict(rtol=1e-5, atol=1e-6)


def llama(layers=1):
    import transformers as T

    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=layers, num_attention_heads=2,
                                            num_key_value_heads=1, max_position_embeddings=32))


def lm(m, b):
    return m(input_ids=b, labels=b).loss


BATCH = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def eager_steps(model, steps=2, lr=0.1):
    """Losses of `steps` eager SGD steps (SGD: a wrong gradient scale shows)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = lm(model, BATCH)
        loss.backward()
        opt.step()
        out.append(loss.detach())
    return out


class CompiledModels(unittest.TestCase):
    def test_blocks_compiled_with_fullgraph_are_recorded_through(self):
        # torchtitan's apply_compile: every block compiled with fullgraph=True.
        ref = llama(2)
        model = copy.deepcopy(ref)
        for i, block in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(block, fullgraph=True)
        with self.assertWarnsRegex(UserWarning, r"module 'model\.layers\.0', module 'model\.layers\.1' are "
                                                r"compiled .* kernels='inductor'"):
            step = mt.capture(model, torch.optim.SGD(model.parameters(), lr=0.1), BATCH, lm)
        want = eager_steps(ref)
        for w in want:
            torch.testing.assert_close(step(BATCH), w, rtol=0, atol=0)
        for a, b in zip(ref.parameters(), model.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)

    def test_a_model_compiled_whole_and_by_module_compile_is_recorded_through(self):
        for how in ("torch.compile", "module.compile"):
            with self.subTest(how=how):
                ref = llama(1)
                model = copy.deepcopy(ref)
                if how == "torch.compile":
                    run = torch.compile(model)
                else:
                    model.compile()
                    run = model
                with self.assertWarnsRegex(UserWarning, "the model is compiled with torch.compile"):
                    step = mt.capture(run, torch.optim.SGD(run.parameters(), lr=0.1), BATCH, lm)
                for w in eager_steps(ref):
                    torch.testing.assert_close(step(BATCH), w, rtol=0, atol=0)

    def test_settings_inductor_kernels_cannot_honour_are_refused_by_name(self):
        cases = [
            (dict(backend="aot_eager"), r"module 'model\.layers\.0' is compiled with backend 'aot_eager'"),
            (dict(dynamic=True), r"module 'model\.layers\.0' is compiled with dynamic=True"),
            (dict(mode="reduce-overhead"), r"CUDA graphs"),
        ]
        for kw, why in cases:
            with self.subTest(**{k: str(v) for k, v in kw.items()}):
                model = llama(1)
                model.model.layers[0] = torch.compile(model.model.layers[0], **kw)
                with self.assertRaisesRegex(mt.UnsupportedStep, why):
                    mt.capture(model, torch.optim.SGD(model.parameters(), lr=0.1), BATCH, lm, kernels="inductor")
        with self.assertRaisesRegex(ValueError, "kernels must be one of 'eager', 'inductor', not 'triton'"):
            mt.capture(llama(1), torch.optim.SGD(llama(1).parameters(), lr=0.1), BATCH, lm, kernels="triton")


class InductorKernels(unittest.TestCase):
    def test_the_planned_step_with_inductor_kernels_equals_eager_within_tolerance(self):
        ref = llama(1)
        model = copy.deepcopy(ref)
        step = mt.capture(model, torch.optim.SGD(model.parameters(), lr=0.1), BATCH, lm, kernels="inductor")
        self.assertEqual(step.kernels, "inductor")
        for w in eager_steps(ref, steps=3):
            torch.testing.assert_close(step(BATCH), w, **INDUCTOR_TOL)
        for a, b in zip(ref.parameters(), model.parameters()):
            torch.testing.assert_close(a, b, **INDUCTOR_TOL)
        s = step.stats["inductor"]
        self.assertGreater(s["regions"], 3)
        self.assertEqual(s["compiled_regions"], s["regions"])
        self.assertEqual(s["eager_regions"], 0)
        # Fusing never raises the plan's max live; the fused step's plan
        # passes the independent checker.
        fused = step._planning.fused.report
        self.assertLessEqual(s["fused_max_live_bytes"], step.plan["stats"]["max_live_bytes"])
        report = memplan.check(fused["graph"], fused["plan"])
        self.assertEqual(report["max_live_bytes"], s["fused_max_live_bytes"])
        # What the allocator holds while it runs (compiled kernels' own
        # buffers included) stays within the fused plan's max live.
        peak = allocator_peak(lambda: step(BATCH), list(model.parameters()))
        self.assertLessEqual(peak, s["fused_max_live_bytes"] * 1.01)
        # The compiled regions are kept: a second step object of the same
        # model and layouts compiles nothing.
        again = mt.capture(model, torch.optim.SGD(model.parameters(), lr=0.1), BATCH, lm, kernels="inductor")
        with mock.patch("torch._inductor.compile", side_effect=AssertionError("compiled again")):
            again(BATCH)
        self.assertEqual(again.stats["inductor"]["compiled_regions"], s["regions"])

    def test_a_region_inductor_fails_on_runs_with_eager_kernels_and_says_so(self):
        ref = llama(1)
        model = copy.deepcopy(ref)
        step = mt.capture(model, torch.optim.SGD(model.parameters(), lr=0.1), BATCH, lm)
        step.kernels = "inductor"
        _fused._COMPILED.clear()
        with mock.patch("torch._inductor.compile", side_effect=RuntimeError("no compiler here")):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                got = [step(BATCH) for _ in range(2)]
        said = [str(w.message) for w in seen if "memplan region" in str(w.message)]
        self.assertTrue(said and all("Inductor failed to compile it (RuntimeError: no compiler here); it runs "
                                     "with eager kernels" in m for m in said), said)
        self.assertEqual(step.stats["inductor"]["eager_regions"], step.stats["inductor"]["regions"])
        for g, w in zip(got, eager_steps(ref)):
            torch.testing.assert_close(g, w, rtol=0, atol=0)

    def test_inductor_kernels_refuse_the_arena(self):
        model = llama(1)
        step = mt.capture(model, torch.optim.SGD(model.parameters(), lr=0.1), BATCH, lm, kernels="inductor")
        with self.assertRaisesRegex(mt.UnsupportedStep, "kernels='inductor' .* not in the arena yet"):
            step(BATCH, arena=True)
        step.kernels = "eager"
        step(BATCH, arena=True)


class Fuse(unittest.TestCase):
    def test_fuse_names_what_it_refuses(self):
        g = memplan.example("gpt2-tiny")
        order = memplan.plan(g)["order"]
        with self.assertRaisesRegex(memplan.MemplanError, 'order names op "nope", which the graph lacks'):
            memplan.fuse(g, ["nope"] + order[1:])
        with self.assertRaisesRegex(memplan.MemplanError, "lists op .* twice"):
            memplan.fuse(g, [order[0]] + order[:-1])
        r = memplan.fuse(g, order)
        self.assertGreater(len(r["regions"]), 0)
        self.assertLessEqual(r["max_live_bytes"], r["unfused_max_live_bytes"])


if __name__ == "__main__":
    unittest.main()
