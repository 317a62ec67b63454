"""tools/torch_remat_compare.py: AOTAutograd's forward and backward graphs
as one memplan graph, FLOPs as PyTorch counts them."""

import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F
from functorch.compile import default_partition, min_cut_rematerialization_partition
from torch.utils.flop_counter import FlopCounterMode

import memplan
from tools import torch_remat_compare as trc


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8))

    def forward(self, x, y):
        return F.mse_loss(self.body(x), y)


class ConvertTest(unittest.TestCase):
    def setUp(self):
        torch.manual_seed(0)
        self.net = Net()
        self.args = (torch.randn(16, 32), torch.randn(16, 8))

    def test_saved_graph_plans_checks_and_counts_eager_flops(self):
        g = trc.to_memplan(*trc.capture(self.net, self.args, default_partition), "net")
        plan = memplan.plan(g, time_limit=2)
        memplan.check(g, plan)
        with FlopCounterMode(display=False) as counter:
            self.net(*self.args).backward()
        self.net.zero_grad(set_to_none=True)
        counted = sum(o["flops"] for o in g["ops"]
                      if any(k in o["type"] for k in ("mm", "addmm")))
        self.assertEqual(counted, counter.get_total_flops())
        roles = {t["id"]: (t["role"], t["lifetime"]) for t in g["tensors"]}
        params = [k for k, (r, _) in roles.items() if r == "parameter"]
        grads = [k for k, (r, _) in roles.items() if r == "gradient"]
        self.assertEqual(len(params), 6)  # 2 linear layers and a norm, weight and bias each
        self.assertEqual(len(grads), 6)
        views = [t for t in g["tensors"] if "view_of" in t]
        self.assertTrue(views, "transposes and views come out as views")

    def test_recomputing_partition_adds_forward_work_to_the_backward(self):
        base = trc.to_memplan(*trc.capture(self.net, self.args, default_partition), "net")
        remat = trc.to_memplan(*trc.capture(self.net, self.args, min_cut_rematerialization_partition, 0.0),
                               "net-remat")
        memplan.check(remat, memplan.plan(remat, time_limit=2))
        self.assertGreater(trc.total_flops(remat), trc.total_flops(base))
        self.assertTrue(any(o["kind"] == "backward" and "gelu" in o["type"] and "backward" not in o["type"]
                            for o in remat["ops"]), "the GELU is recomputed in the backward")


if __name__ == "__main__":
    unittest.main()


class FakeTracingTest(unittest.TestCase):
    def test_fake_tensors_give_the_real_runs_graphs(self):
        """--fake: the same memplan graphs (ops, reads, writes, sizes, FLOPs)
        as a real run, for the saved and a recomputing partition of the
        script's GPT-2."""
        import sys

        from torch._subclasses.fake_tensor import FakeTensorMode

        sys.path.insert(0, "tools")
        import torch_eager_gpt2

        cfg = torch_eager_gpt2.parse_args(["--config", "gpt2-tiny", "--device", "cpu", "--layers", "1"])

        def graphs(partition, budget):
            torch.manual_seed(0)
            model = torch_eager_gpt2.build(cfg, torch)
            tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
            return trc.to_memplan(*trc.capture(model, (tokens, tokens), partition, budget), "g")

        for partition, budget in ((default_partition, 1.0), (min_cut_rematerialization_partition, 0.3)):
            real = graphs(partition, budget)
            with FakeTensorMode(allow_non_fake_inputs=True):
                fake = graphs(partition, budget)
            self.assertEqual(real["ops"], fake["ops"])
            self.assertEqual(real["tensors"], fake["tensors"])
