"""The recorder (memplan.torch's one, recording without replay), the CUDA
emulation, the export driver in both update modes and the CLI, on tiny
models.

Skipped with a message where torch is not importable.
"""

import io
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout

try:
    import torch

    HAVE_TORCH = True
except ImportError:  # pragma: no cover - depends on the machine
    HAVE_TORCH = False

from memplan.torch.export import graph

SKIP = "torch is not installed (pip install torch torchvision transformers to run these tests)"
if not HAVE_TORCH:
    sys.stderr.write(f"memplan.torch.export: skipping the exporter's torch tests: {SKIP}\n")


def by_id(d):
    return {t["id"]: t for t in d["tensors"]}


def roots(d):
    ts = by_id(d)

    def root(x):
        while "view_of" in ts[x]:
            x = ts[x]["view_of"]
        return x

    return root


def lifetimes(d):
    """Each root tensor's first and last op (by index in the listed order),
    reads through views included: a test's own liveness, to ask where a
    tensor is made and last used."""
    root = roots(d)
    birth, death = {}, {}
    for k, o in enumerate(d["ops"]):
        for field in ("inputs", "outputs", "updates"):
            for t in o.get(field, []):
                r = root(t)
                birth.setdefault(r, k)
                death[r] = k
    return birth, death


@unittest.skipUnless(HAVE_TORCH, SKIP)
class RecorderTest(unittest.TestCase):
    def record(self, fn, *tensors):
        from memplan.torch._record import Recorder

        rec = Recorder("meta", 256, replay=False)
        for i, t in enumerate(tensors):
            rec.table.register(t, f"in{i}", "input")
        with rec:
            fn(*tensors)
        return rec.finish("t", {})

    def test_views_and_in_place_updates_follow_storage(self):
        x = torch.empty(4, 8, device="meta")

        def f(x):
            y = x * 2  # new storage: 128 bytes
            v = y.view(8, 4)  # a view of y
            v.add_(1)  # updates y's bytes through the view
            z = v.t().contiguous()  # a copy: new storage
            x.copy_(z.view(4, 8))  # updates the input

        d = self.record(f, x)
        graph.check(d)
        ts, root = by_id(d), roots(d)
        ops = d["ops"]
        self.assertEqual([o["type"] for o in ops][:3],
                         ["aten.mul.Tensor", "aten.view.default", "aten.add_.Tensor"])
        y = ops[0]["outputs"][0]
        self.assertEqual(ts[y]["size"], 4 * 8 * 4)
        v = ops[1]["outputs"][0]
        self.assertEqual(ts[v]["view_of"], y)
        self.assertEqual(ops[2]["updates"], [v])
        self.assertNotIn("outputs", ops[2])
        copy = ops[-1]
        self.assertEqual(copy["type"], "aten.copy_.default")
        self.assertEqual(copy["updates"], ["in0"])
        self.assertEqual(root(copy["inputs"][0]), ops[-3]["outputs"][0])

    def test_batch_norm_updates_its_statistics_and_makes_no_masked_gradient(self):
        # native_batch_norm does not declare that it writes its running
        # statistics, and the fake kernel of its backward makes the input
        # gradient its output_mask switches off; the graph has neither
        # mistake.
        x, w, b = (torch.empty(*s, device="meta") for s in ((4, 3, 5), (3,), (3,)))
        rm, rv, dy = torch.empty(3, device="meta"), torch.empty(3, device="meta"), torch.empty(4, 3, 5, device="meta")

        def f(x, w, b, rm, rv, dy):
            _, mean, invstd = torch.ops.aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)
            torch.ops.aten.native_batch_norm_backward(dy, x, w, rm, rv, mean, invstd, True, 1e-5,
                                                      [False, True, True])

        d = self.record(f, x, w, b, rm, rv, dy)
        graph.check(d)
        forward, backward = d["ops"]
        self.assertEqual(forward["updates"], ["in3", "in4"])
        self.assertEqual(len(backward["outputs"]), 2)

    def test_fake_tensors_keep_storage_identity(self):
        # The GPU path traces FakeTensors; their storages must behave as
        # meta storages do (CPU fake tensors stand in for CUDA ones here).
        from torch._subclasses.fake_tensor import FakeTensorMode

        from memplan.torch._record import Recorder

        with FakeTensorMode():
            x = torch.empty(4, 8)
            rec = Recorder("cpu", 256, replay=False)
            rec.table.register(x, "x", "input")
            with rec:
                y = x * 2
                y.view(8, 4).add_(1)
                x.copy_(y)
        d = rec.finish("fake", {})
        graph.check(d)
        mul, view, add_, copy_ = d["ops"]
        y_id = mul["outputs"][0]
        self.assertEqual(by_id(d)[y_id]["size"], 128)
        self.assertEqual(by_id(d)[view["outputs"][0]]["view_of"], y_id)
        self.assertEqual(add_["updates"], view["outputs"])
        self.assertEqual((copy_["updates"], copy_["inputs"]), (["x"], [y_id]))

    def test_pointwise_ops_get_reuse_hints_for_same_layout_inputs(self):
        x = torch.empty(4, 8, device="meta")
        b = torch.empty(8, device="meta")

        def f(x, b):
            y = x * 2  # pointwise, same layout as x: hint
            z = y + b  # b is broadcast: only y qualifies
            zt = z.t() * 3  # the output keeps the input's strides: hint
            z[:, :4] * 3  # part of z's storage: no hint
            zt.sum()  # not pointwise: no hint

        d = self.record(f, x, b)
        graph.check(d)
        mul, add, t, mul_t, sl, mul_part, total = d["ops"]
        self.assertEqual(mul["reuse"], [{"output": mul["outputs"][0], "input": "in0"}])
        self.assertEqual(add["reuse"], [{"output": add["outputs"][0], "input": mul["outputs"][0]}])
        self.assertEqual(mul_t["reuse"], [{"output": mul_t["outputs"][0], "input": t["outputs"][0]}])
        self.assertEqual(sl["type"], "aten.slice.Tensor")
        self.assertNotIn("reuse", mul_part)
        self.assertNotIn("reuse", total)

    def test_host_tensors_take_no_bytes(self):
        x = torch.empty(16, device="meta")
        c = torch.ones(3)  # on the host

        def f(x, c):
            (x.sum() + 1).mul(2)
            c.add_(1)

        d = self.record(f, x, c)
        ts = by_id(d)
        self.assertEqual(ts["in1"]["size"], 0)
        self.assertEqual(ts["in0"]["size"], 64)

    def test_recorder_keeps_storage_keys_unique(self):
        # Freed temporaries must not be confused with later storages that
        # could reuse their address.
        x = torch.empty(64, device="meta")

        def f(x):
            for _ in range(50):
                (x + 1).sum()

        d = self.record(f, x)
        graph.check(d)
        adds = [o for o in d["ops"] if o["type"] == "aten.add.Tensor"]
        outs = {o["outputs"][0] for o in adds}
        self.assertEqual(len(outs), 50)
        self.assertTrue(all("view_of" not in by_id(d)[t] for t in outs))


@unittest.skipUnless(HAVE_TORCH, SKIP)
class EmulationTest(unittest.TestCase):
    def test_backend_rule(self):
        from memplan.torch.export.emulate import sdpa_backend

        q32 = torch.empty(2, 4, 16, 64, device="meta")
        q16 = torch.empty(2, 4, 16, 64, device="meta", dtype=torch.bfloat16)
        mask = torch.empty(16, 16, device="meta", dtype=torch.bool)
        self.assertEqual(sdpa_backend(q32, None, 0.0), "efficient")
        self.assertEqual(sdpa_backend(q16, None, 0.1), "flash")
        self.assertEqual(sdpa_backend(q16, mask, 0.0), "efficient")
        odd = torch.empty(2, 4, 16, 20, device="meta")
        self.assertEqual(sdpa_backend(odd, None, 0.0), "math")

    def test_emulation_is_scoped(self):
        import torch.nn.functional as F

        from memplan.torch.export.emulate import CudaEmulation, emulated_sdpa

        from memplan.torch.export.emulate import emulated_dropout

        before = F.scaled_dot_product_attention, F.dropout
        with CudaEmulation():
            self.assertIs(F.scaled_dot_product_attention, emulated_sdpa)
            self.assertIs(F.dropout, emulated_dropout)
        self.assertEqual((F.scaled_dot_product_attention, F.dropout), before)

    def test_dropout_saves_a_byte_mask(self):
        from memplan.torch._record import Recorder
        from memplan.torch.export.emulate import CudaEmulation

        x = torch.empty(4, 256, device="meta", requires_grad=True)
        rec = Recorder("meta", 256, replay=False)
        rec.table.register(x, "x", "input")
        with CudaEmulation(), rec:
            torch.nn.Dropout(0.1)(x).sum().backward()
        d = rec.finish("d", {})
        graph.check(d)
        ts = by_id(d)
        fwd = [o for o in d["ops"] if o["type"] == "aten.native_dropout.default"]
        self.assertEqual(len(fwd), 1)
        out, mask = fwd[0]["outputs"]
        self.assertEqual((ts[out]["size"], ts[mask]["size"]), (4096, 1024))
        self.assertEqual(ts[mask]["dtype"], "bool")
        bwd = [o for o in d["ops"] if o["type"] == "aten.native_dropout_backward.default"]
        self.assertEqual(len(bwd), 1)
        self.assertIn(mask, bwd[0]["inputs"])

    def test_random_ops_update_the_generator_in_eager_order(self):
        from memplan.torch._record import Recorder
        from memplan.torch.export.emulate import CudaEmulation

        # Two dropouts on independent branches and a `rand` that reads no
        # tensor: only the generator orders them.
        x = torch.empty(4, 256, device="meta", requires_grad=True)
        rec = Recorder("meta", 256, replay=False)
        rec.table.register(x, "x", "input")
        with CudaEmulation(), rec:
            drop = torch.nn.Dropout(0.1)
            noise = torch.rand(4, 256, device="meta")
            (drop(x * 2).sum() + drop(x * 3).sum() + (x * noise).sum()).backward()
        d = rec.finish("d", {})
        graph.check(d)
        rng = by_id(d)["rng:meta"]
        self.assertEqual((rng["size"], rng["role"], rng["lifetime"]), (0, "input", "persistent"))
        drawn = [o for o in d["ops"] if "rng:meta" in o.get("updates", [])]
        self.assertEqual([o["type"] for o in drawn],
                         ["aten.rand.default"] + ["aten.native_dropout.default"] * 2)
        # A plan keeps that order, though the draws depend on nothing else.
        from memplan import plan

        order = [o for o in plan(d, time_limit=2)["order"] if o in {op["id"] for op in drawn}]
        self.assertEqual(order, [o["id"] for o in drawn])

    def test_emulated_attention_matches_math_on_cpu(self):
        from memplan.torch.export.emulate import emulated_sdpa

        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))
        mask = torch.rand(8, 8) > 0.3
        mask.fill_diagonal_(True)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        # The efficient kernel has no CPU implementation; the bool-mask
        # conversion is what runs before it, check it against math.
        bias = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(mask.logical_not(), float("-inf"))
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        self.assertTrue(torch.allclose(want, got, atol=1e-6))
        # Odd head dims keep the math path, which runs anywhere.
        q5 = torch.randn(1, 2, 8, 5)
        self.assertTrue(torch.allclose(
            emulated_sdpa(q5, q5, q5, is_causal=True),
            torch.nn.functional.scaled_dot_product_attention(q5, q5, q5, is_causal=True)))


@unittest.skipUnless(HAVE_TORCH, SKIP)
class StepTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from memplan.torch.export import step

        cls.mlp = step.export("mlp", batch=8)
        cls.attn = step.export("tiny-attn", batch=2, seq=16)
        cls.mlp_eager = step.export("mlp", batch=8, update="eager")
        cls.attn_eager = step.export("tiny-attn", batch=2, seq=16, update="eager")
        cls.all = (cls.mlp, cls.attn, cls.mlp_eager, cls.attn_eager)

    def test_graph_is_valid(self):
        for d in self.all:
            graph.check(d)
            self.assertEqual(d["metadata"]["trace_device"], "meta")
        self.assertEqual(self.mlp_eager["metadata"]["unseen_storages"], 1)  # AdamW's constant 1.0
        self.assertEqual([d["metadata"]["update"] for d in self.all], ["memplan"] * 2 + ["eager"] * 2)

    def test_the_default_is_the_step_capture_records(self):
        # The export is capture's graph: the same ops as memplan.torch plans
        # and runs for the same model, optimizer and batch.
        import memplan.torch
        from memplan.torch.export import step, workloads

        with torch.device("meta"):
            w = workloads.mlp(batch=8)
        opt = step.make_optimizer("adamw", w.model)
        g = memplan.torch.capture(w.model, opt, w.batch, w.loss, plan=False, meta_device="meta").graph
        self.assertEqual([o["type"] for o in g["ops"]], [o["type"] for o in self.mlp["ops"]])
        self.assertEqual([t["size"] for t in g["tensors"]], [t["size"] for t in self.mlp["tensors"]])

    def test_eager_records_the_optimizers_own_foreach_kernels(self):
        # Eager: AdamW's _foreach kernels, each over all six parameters;
        # memplan: each parameter's update on its own, so no update op
        # touches two parameters and memplan may run each as soon as its
        # gradient is made.
        six = [o for o in self.mlp_eager["ops"] if o["type"] == "aten._foreach_mul_.Scalar"]
        self.assertTrue(six and all(len(o["updates"]) == 6 for o in six))
        params = {t["id"] for t in self.mlp["tensors"] if t["role"] == "parameter"}
        mine = [o for o in self.mlp["ops"] if o["kind"] == "optimizer"]
        self.assertTrue(mine)
        self.assertTrue(all(len(params.intersection(o.get("updates", []))) <= 1 for o in mine))
        self.assertFalse([o["type"] for o in mine if "_foreach_" in o["type"]])

    def test_phases_are_in_order(self):
        for d in self.all:
            kinds = [o["kind"] for o in d["ops"]]
            order = {"forward": 0, "backward": 1, "optimizer": 2}
            self.assertEqual(kinds, sorted(kinds, key=order.__getitem__))
            self.assertEqual(set(kinds), set(order))

    def test_roles_and_lifetimes(self):
        for d in (self.mlp, self.mlp_eager):
            self.check_roles_and_lifetimes(d)
        ts = by_id(self.mlp_eager)
        self.assertEqual(sorted(t["id"] for t in ts.values() if t["role"] == "input"
                                and "view_of" not in t), ["input:x", "input:y", "unseen1"])

    def check_roles_and_lifetimes(self, d):
        ts = by_id(d)
        root = roots(d)
        params = [t for t in ts.values() if t["id"].startswith("param:")]
        self.assertEqual(len(params), 6)
        self.assertTrue(all(t["lifetime"] == "persistent" for t in params))
        state = [t for t in ts.values() if t["role"] == "optimizer_state" and "view_of" not in t]
        steps = [t for t in state if t["id"].endswith(".step")]
        # exp_avg and exp_avg_sq per parameter, and in eager's step the step
        # counters, on the host (memplan.torch counts steps in Python).
        self.assertEqual((len(state), len(steps)), (18, 6) if d["metadata"]["update"] == "eager" else (12, 0))
        self.assertTrue(all(t["lifetime"] == "persistent" for t in state))
        self.assertTrue(all(t["size"] == 0 for t in steps))
        batch = [t for t in ts.values() if t["id"].startswith("input:")]
        self.assertEqual(len(batch), 2)
        self.assertTrue(all(t["lifetime"] == "persistent" for t in batch))  # the caller holds the batch
        buffers = [t for t in ts.values() if t["id"].startswith("buffer:")]
        self.assertEqual(len(buffers), 3)
        # BatchNorm's step counter is updated in place in the forward pass.
        upd = [o for o in d["ops"] if "buffer:1.num_batches_tracked" in o.get("updates", [])]
        self.assertEqual(len(upd), 1)
        self.assertEqual(upd[0]["kind"], "forward")
        # The loss: a persistent output made in the forward pass.
        outs = [t for t in ts.values() if t["role"] == "output" and "view_of" not in t]
        self.assertEqual(len(outs), 1)
        self.assertEqual(outs[0]["lifetime"], "persistent")
        self.assertEqual(outs[0]["shape"], [])
        # One gradient per parameter, each made by the backward pass and
        # last used by the optimizer.
        grads = {t["id"] for t in ts.values() if t["role"] == "gradient" and "view_of" not in t}
        self.assertEqual(len(grads), 6)
        birth, death = lifetimes(d)
        kind_at = [o["kind"] for o in d["ops"]]
        for g in grads:
            self.assertEqual(ts[g]["lifetime"], "transient")
            self.assertEqual(kind_at[birth[g]], "backward")
            self.assertEqual(kind_at[death[g]], "optimizer")
        # Every parameter is updated in place by the optimizer.
        updated = {root(x) for o in d["ops"] if o["kind"] == "optimizer" for x in o.get("updates", [])}
        self.assertTrue({p["id"] for p in params} <= updated)
        # No activation outlives the backward pass.
        last_bwd = max(i for i, k in enumerate(kind_at) if k == "backward")
        for t in ts.values():
            if t["role"] == "activation" and t["id"] in death and t["lifetime"] == "transient":
                self.assertLessEqual(death[t["id"]], last_bwd, t["id"])

    def test_flops_are_pytorchs_formulas(self):
        from torch.utils.flop_counter import FlopCounterMode

        from memplan.torch.export import workloads

        w = workloads.mlp(batch=8)
        with FlopCounterMode(display=False) as counter:
            w.loss(w.model, w.batch).backward()
        total = sum(o.get("flops", 0) for o in self.mlp["ops"])
        self.assertGreater(total, 0)
        self.assertEqual(total, counter.get_total_flops())
        mm = [o for o in self.mlp["ops"] if o["type"].startswith(("aten.addmm", "aten.mm"))]
        self.assertTrue(mm and all(o["flops"] > 0 for o in mm))
        self.assertEqual(self.mlp["metadata"]["batch"], 8)

    def test_attention_takes_the_cuda_kernel(self):
        types = [o["type"] for o in self.attn["ops"]]
        self.assertIn("aten._scaled_dot_product_efficient_attention.default", types)
        self.assertIn("aten._scaled_dot_product_efficient_attention_backward.default", types)
        self.assertFalse(any("softmax.default" in t and "log" not in t for t in types), types)

    def test_resident_bytes(self):
        # Parameters (11,560 bytes), AdamW's two moments of the same size,
        # BatchNorm's running mean and variance (64 f32 each) and its i64
        # step counter; the AdamW step counters live on the host.
        for d in (self.mlp, self.mlp_eager):
            resident = sum(t["size"] for t in d["tensors"]
                           if t["lifetime"] == "persistent" and "view_of" not in t
                           and t["role"] in ("parameter", "optimizer_state"))
            self.assertEqual(resident, 3 * 11560 + 256 * 2 + 8)
            self.assertGreater(graph.program_order_max_live(d), resident)

    def test_unknown_names_are_clear_errors(self):
        from memplan.torch.export import step

        with self.assertRaisesRegex(ValueError, "unknown model 'nope'"):
            step.export("nope")
        with self.assertRaisesRegex(ValueError, "unknown optimizer"):
            step.export("mlp", optimizer="lion")
        with self.assertRaisesRegex(ValueError, "cannot load"):
            step.export("no.such.module:f")
        with self.assertRaisesRegex(ValueError, "unknown update 'lazy'"):
            step.export("mlp", update="lazy")


@unittest.skipUnless(HAVE_TORCH, SKIP)
class MeasureTest(unittest.TestCase):
    def test_measure_resets_after_warm_up(self):
        """The real-run path, on the CPU with a stand-in for CUDA's counters:
        the counters are reset once the optimizer state exists and no
        gradient is held, and the measured step really trains."""
        from memplan.torch.export import step

        seen = {}

        class Stats:
            calls = []

            def synchronize(self):
                self.calls.append("sync")

            def reset(self):
                self.calls.append("reset")

            def peaks(self):
                self.calls.append("peaks")
                return {"torch-allocated": 1234, "torch-reserved": 5678}

        def observe(stage, w, opt):
            params = list(w.model.parameters())
            if stage == "reset":
                seen["state"] = len(opt.state)
                seen["grads"] = sum(p.grad is not None for p in params)
                seen["params"] = [p.detach().clone() for p in params]
            else:
                seen["changed"] = sum(
                    not torch.equal(a, p) for a, p in zip(seen["params"], params))
                seen["steps"] = [float(s["step"]) for s in opt.state.values()]

        stats = Stats()
        peaks = step.measure("mlp", batch=8, device="cpu", stats=stats, observe=observe)
        self.assertEqual(stats.calls, ["sync", "reset", "sync", "peaks"])
        self.assertEqual(peaks, {"torch-allocated": 1234, "torch-reserved": 5678})
        self.assertEqual(seen["state"], 6)
        self.assertEqual(seen["grads"], 0)
        self.assertEqual(seen["changed"], 6)
        self.assertEqual(seen["steps"], [2.0] * 6)


@unittest.skipUnless(HAVE_TORCH, SKIP)
class CliTest(unittest.TestCase):
    def test_cli_writes_a_loadable_graph(self):
        from memplan.torch.export.__main__ import main

        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "mlp.json.gz")
            buf = io.StringIO()
            with redirect_stdout(buf):
                rc = main(["--model", "mlp", "--batch", "4", "--trace-device", "meta",
                           "--measure", "no", "-o", out])
            self.assertEqual(rc, 0)
            d = graph.load(out)
            self.assertEqual(d["metadata"]["config"]["batch"], 4)
            live = graph.program_order_max_live(d)
            self.assertEqual(d["metadata"]["program_order_max_live_bytes"], live)
            self.assertIn(f"program-order max live {live:,} bytes", buf.getvalue())

    def test_cli_errors(self):
        from memplan.torch.export.__main__ import main

        err = io.StringIO()
        with redirect_stderr(err):
            self.assertEqual(main(["--model", "mlp"]), 2)
            self.assertEqual(main(["--model", "nope", "-o", "x.json"]), 2)
        self.assertIn("give --model and -o", err.getvalue())
        self.assertIn("unknown model 'nope'", err.getvalue())


if __name__ == "__main__":
    unittest.main()
