"""Splitting the captured loss chain (``capture(..., split=...)``,
memplan.torch._split): split steps of Hugging Face models equal eager's,
hold what their plans say, and are never made where they do not pay."""

import copy
import math
import random
import unittest

import torch
import torch.nn.functional as F

import memplan
import memplan.torch as mt
from memplan.torch import _split

# Documented tolerances (docs/step.md, docs/splitting.md): float32 steps
# differ from eager by summation order only.
LOSS_RTOL_F32 = 1e-5
PARAM_RTOL_F32 = 1e-5
LOSS_RTOL_BF16 = 1e-4
PARAM_RTOL_BF16 = 5e-3


def _hf_models():
    import transformers as T

    tokens = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64)
    return [
        ("gpt2", lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000,
                                                        n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                                        attn_pdrop=0.0))),
        ("llama", lambda: T.LlamaForCausalLM(T.LlamaConfig(**tokens, num_key_value_heads=2,
                                                           tie_word_embeddings=True))),
        ("qwen2", lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**tokens, num_key_value_heads=2))),
    ]


def _hf_loss(m, b):
    return m(input_ids=b, labels=b).loss


def _bf16_loss(m, b):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return m(input_ids=b, labels=b).loss


def _rel(a, b) -> float:
    num = sum(float((x.detach() - y.detach()).double().norm() ** 2) for x, y in zip(a, b)) ** 0.5
    den = sum(float(x.detach().double().norm() ** 2) for x in a) ** 0.5
    return num / den


def _checked(step):
    """The step's plan passes memplan's independent checker."""
    memplan.check(step.graph, step.plan)


class HuggingFaceSplitSteps(unittest.TestCase):
    def _compare(self, make, loss_fn, k, loss_rtol, param_rtol, arena=False):
        torch.manual_seed(0)
        m0 = make()
        eager, ours = copy.deepcopy(m0), copy.deepcopy(m0)
        eopt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
        opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, 1000, (2, 16), generator=g) for _ in range(3)]
        step = mt.capture(ours, opt, batches[0], loss_fn, split=k)
        self.assertEqual(step.split["chunks"], k, step.split)
        self.assertEqual(len(step.split["chains"]), 1)
        self.assertTrue(any("split_of" in op.get("attrs", {}) for op in step.graph["ops"]))
        self.assertLess(step.split["arena_bytes"], step.split["unsplit_arena_bytes"])
        _checked(step)
        for b in batches:
            le = loss_fn(eager, b)
            le.backward()
            eopt.step()
            eopt.zero_grad(set_to_none=True)
            ls = step.run(b, track=True, arena=arena)
            self.assertLessEqual(abs(float(ls) - float(le)), loss_rtol * abs(float(le)))
            if not arena:
                self.assertEqual(step.tracked_peak_bytes, step.plan["stats"]["max_live_bytes"])
        self.assertLess(_rel(list(eager.parameters()), list(ours.parameters())), param_rtol)

    def test_float32_steps_equal_eager(self):
        for name, make in _hf_models():
            for k in (2, 3):
                with self.subTest(model=name, chunks=k):
                    self._compare(make, _hf_loss, k, LOSS_RTOL_F32, PARAM_RTOL_F32)

    def test_bf16_autocast_llama(self):
        self._compare(_hf_models()[1][1], _bf16_loss, 4, LOSS_RTOL_BF16, PARAM_RTOL_BF16)

    def test_in_the_arena(self):
        self._compare(_hf_models()[2][1], _hf_loss, 3, LOSS_RTOL_F32, PARAM_RTOL_F32, arena=True)

    def test_soft_capped_logits(self):
        """Pointwise ops between the logits and the loss (Gemma 2's
        soft-capping: divide, tanh, multiply; and their backward ops) are
        split with the chain."""
        def capped(model, b):
            logits = 30.0 * torch.tanh(model(input_ids=b).logits / 30.0)
            labels = F.pad(b, (0, 1), value=-100)[:, 1:]  # shifted as Hugging Face's loss shifts them
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)

        self._compare(_hf_models()[1][1], capped, 3, LOSS_RTOL_F32, PARAM_RTOL_F32)

    def test_auto_picks_a_count_that_lowers_the_arena(self):
        torch.manual_seed(0)
        m = _hf_models()[1][1]()
        step = mt.capture(m, torch.optim.AdamW(m.parameters()), torch.zeros((2, 32), dtype=torch.long),
                          _hf_loss, split="auto")
        tried = {t["chunks"]: t["arena_bytes"] for t in step.split["tried"]}
        self.assertGreater(step.split["chunks"], 1)
        self.assertEqual(min(tried.values()), step.plan["arena_bytes"])
        self.assertEqual(tried[step.split["chunks"]], step.plan["arena_bytes"])
        self.assertEqual(tried[1], step.split["unsplit_arena_bytes"])
        _checked(step)


    def test_split_then_fitted(self):
        """``capture(split=..., max_added=...)``: the fit starts from the
        split step (recomputing its chunks' ops too) and goes below both;
        the share is of the step as captured, the split's FLOPs counted in
        it, and a share below the split's own FLOPs undoes the split."""
        torch.manual_seed(0)
        m0 = _hf_models()[1][1]()
        b = torch.randint(0, 1000, (2, 32))
        arena, losses, steps = {}, {}, {}
        share = 0.01
        for key, kw in (("split", {"split": 4}), ("fit", {"max_added": share}),
                        ("both", {"split": 4, "max_added": share})):
            m = copy.deepcopy(m0)
            step = mt.capture(m, torch.optim.AdamW(m.parameters()), b, _hf_loss, **kw)
            losses[key] = float(step.run(b, track=True))
            self.assertEqual(step.tracked_peak_bytes, step.plan["stats"]["max_live_bytes"])
            _checked(step)
            arena[key], steps[key] = step.plan["arena_bytes"], step
            if key == "both":
                self.assertEqual(step.split["chunks"], 4)
                self.assertGreater(len(step.fitted["recomputed_ops"]), 0)
        self.assertLess(arena["both"], min(arena["split"], arena["fit"]))
        self.assertAlmostEqual(losses["both"], losses["fit"], delta=1e-5 * abs(losses["fit"]))
        flops = lambda g: sum(op.get("flops", 0) for op in g["ops"])  # noqa: E731
        captured = flops(steps["fit"]._planning.captured.graph)
        split_added = steps["split"].split["added_flops"]
        both = steps["both"].fitted
        self.assertEqual(both["split_added_flops"], split_added)
        self.assertGreater(split_added, 0)
        self.assertLessEqual(both["added_flops"] + split_added, share * captured * (1 + 1e-9))
        # A share below the split's own additions: the split is undone and
        # the step as captured is fitted within the share.
        step = steps["split"]
        share = 0.5 * split_added / captured
        fitted = step.fit(max_added=share, minimise="flops", time_limit=5)
        self.assertNotIn("split_added_flops", fitted)
        # (the core's cost model counts the step's FLOPs: `step_flops`)
        self.assertLessEqual(fitted["added_flops"], share * fitted["step_flops"] * (1 + 1e-9))
        self.assertEqual(step.split["chunks"], 1)
        self.assertIn("more than max_added", step.split["dropped"])
        self.assertFalse([op for op in step.graph["ops"] if "split_of" in op.get("attrs", {})])
        loss = float(step.run(b, track=True))
        self.assertEqual(step.tracked_peak_bytes, step.plan["stats"]["max_live_bytes"])
        self.assertTrue(math.isfinite(loss))
        _checked(step)


class NotSeparable(unittest.TestCase):
    def test_a_reduction_over_the_logits_is_not_split(self):
        """An op that sums over rows has no rule: the chain is refused by
        name and the step runs as captured."""
        torch.manual_seed(0)
        m = _hf_models()[1][1]()
        eager = copy.deepcopy(m)

        def with_z_loss(model, b):
            logits = model(input_ids=b).logits
            ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
            return ce + 1e-4 * logits.pow(2).mean()

        b = torch.randint(0, 1000, (2, 16))
        step = mt.capture(m, torch.optim.SGD(m.parameters(), lr=0.1), b, with_z_loss, split="auto")
        self.assertEqual(step.split["chunks"], 1)
        self.assertFalse(any("split_of" in op.get("attrs", {}) for op in step.graph["ops"]))
        self.assertTrue(any("no rule" in c.get("refused", "") for c in step.split["chains"]), step.split)
        eopt = torch.optim.SGD(eager.parameters(), lr=0.1)
        le = with_z_loss(eager, b)
        le.backward()
        eopt.step()
        self.assertLessEqual(abs(float(step(b)) - float(le)), 1e-5 * abs(float(le)))

    def test_no_chain_leaves_the_step_alone(self):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        step = mt.capture(m, torch.optim.SGD(m.parameters(), lr=0.1), torch.randn(16, 8),
                          lambda model, x: model(x).pow(2).mean(), split="auto")
        self.assertEqual(step.split["chunks"], 1)
        self.assertIs(step.graph, step._planning.captured.graph)

    def test_bad_split_argument(self):
        m = torch.nn.Linear(4, 4)
        with self.assertRaises(ValueError):
            mt.capture(m, torch.optim.SGD(m.parameters(), lr=0.1), torch.randn(2, 4),
                       lambda model, x: model(x).sum(), split=1.5)


class RandomChains(unittest.TestCase):
    """Property test: random token-wise chains (rows, width, classes,
    ignored targets, mean or summed loss, micro-batches) split into a random
    number of chunks equal the unsplit step, and their plans check."""

    def test_random_chains(self):
        rng = random.Random(7)
        for case in range(8):
            rows = rng.randint(3, 40)
            width = rng.randint(2, 12)
            classes = rng.randint(width + 1, 60)
            k = rng.randint(2, min(rows, 7))
            reduction = rng.choice(["mean", "sum"])
            accumulate = rng.choice([1, 1, 2])
            seed = rng.randint(0, 10**6)
            with self.subTest(case=case, rows=rows, width=width, classes=classes, k=k, reduction=reduction,
                              accumulate=accumulate):
                torch.manual_seed(seed)
                m0 = torch.nn.Sequential(torch.nn.Linear(5, width), torch.nn.Tanh(),
                                         torch.nn.Linear(width, classes, bias=False))

                def loss_fn(model, batch, reduction=reduction):
                    x, y = batch
                    return F.cross_entropy(model(x), y, reduction=reduction, ignore_index=-100)

                g = torch.Generator().manual_seed(seed)
                x = torch.randn(rows, 5, generator=g)
                y = torch.randint(0, classes, (rows,), generator=g)
                y[torch.rand(rows, generator=g) < 0.2] = -100
                y[0] = 0
                # Distinct tensors per micro-batch (one tensor passed twice is
                # one storage, which the tracker counts once).
                batch = [(x.clone(), y.clone()) for _ in range(accumulate)] if accumulate > 1 else (x, y)
                steps = []
                for split in (None, k):
                    m = copy.deepcopy(m0)
                    s = mt.capture(m, torch.optim.SGD(m.parameters(), lr=0.1), (x, y), loss_fn, plan=False,
                                   accumulate=accumulate)
                    if split is None:
                        s.make_plan()
                    else:
                        s.split_loss(split, only_if_lower=False)
                    _checked(s)
                    steps.append((m, s, float(s.run(batch, track=True))))
                    self.assertEqual(s.tracked_peak_bytes, s.plan["stats"]["max_live_bytes"])
                (m1, s1, l1), (m2, s2, l2) = steps
                self.assertEqual(s2.split["chunks"], k)
                self.assertEqual(len(s2.split["chains"]), accumulate)
                self.assertEqual(len(_split.split_step(s1.graph, s1._planning.calls, s1._planning.layouts, k)[3]), accumulate)
                self.assertAlmostEqual(l1, l2, delta=1e-5 * max(1.0, abs(l1)))
                self.assertLess(_rel(list(m1.parameters()), list(m2.parameters())), 1e-5)


if __name__ == "__main__":
    unittest.main()
