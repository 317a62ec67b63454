#!/usr/bin/env python3
"""`memplan fit` against PyTorch's `activation_memory_budget` on the same
captured step.

PyTorch's answer to "what should I recompute?" is AOTAutograd's min-cut
partitioner with `torch._functorch.config.activation_memory_budget` (a
knapsack over saved bytes, the "dp" solver by default). This script:

1. Captures the forward and backward graphs AOTAutograd makes for a model
   (the GPT-2 of tools/torch_eager_gpt2.py, explicit attention) with
   `default_partition` (everything the backward needs is saved: no
   recomputation) and with the min-cut partitioner at several budgets.
2. Converts each pair to a memplan graph (`to_memplan`): every FX node an op
   (forward or backward), tensors sized from their fake values, views as
   views, parameters and the tangent as step inputs, gradients as step
   outputs; FLOPs from `torch.utils.flop_counter` where PyTorch has a
   formula, else one per output element (the same rule for both sides).
3. For each PyTorch budget, PyTorch's peak is the max live bytes of its graphs in
   their own order (what the caching allocator would see, without its
   fragmentation), and PyTorch's added FLOPs are its graphs' FLOPs minus the
   no-recomputation graphs'. memplan then fits the no-recomputation graphs
   into that same peak (`memplan fit --minimise flops`) and reports the
   FLOPs it adds.
4. For each memplan budget (a share of its plan without recomputation),
   memplan's added FLOPs next to the cheapest PyTorch budget whose peak
   reaches it, if any does.

    .venv/bin/python tools/torch_remat_compare.py --config gpt2-small \
        --budgets 1.0 0.75 0.5 0.25 0.0 --shares 0.9 0.75 0.6
    .venv/bin/python tools/torch_remat_compare.py --config gpt2-xl --fake   # no memory

With --fake, the model and the step are traced on fake tensors: AOTAutograd
and its partitioners see the same shapes and ops, so the graphs are the ones
a real run gives (tested on GPT-2 tiny), without the memory.
"""

import argparse
import contextlib
import json
import operator
import os
import subprocess
import sys
import tempfile

import torch
import torch._functorch.config as functorch_config
from functorch.compile import default_partition, make_boxed_func, min_cut_rematerialization_partition
from torch._functorch.aot_autograd import aot_module_simplified
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map
from memplan.torch._aten import op_flops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_eager_gpt2  # noqa: E402


def capture(model, args, partition, budget=1.0):
    """The (forward, backward) FX graphs AOTAutograd makes for one step."""
    torch._dynamo.reset()
    functorch_config.activation_memory_budget = budget
    graphs = {}

    def compiler(kind):
        def compile_(gm, _example):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)
        return compile_

    def backend(gm, example):
        return aot_module_simplified(gm, example, fw_compiler=compiler("fw"),
                                     bw_compiler=compiler("bw"), partition_fn=partition)

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    compiled(*args).backward()
    model.zero_grad(set_to_none=True)
    return graphs["fw"], graphs["bw"]


def _is_view(target):
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _nbytes(v):
    return v.numel() * v.element_size()


def _flops(node, out):
    """PyTorch's count where it has a formula (memplan.torch's recorder
    uses the same), else one per output element."""
    val = lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a  # noqa: E731
    flops = op_flops(node.target, tree_map(val, node.args), tree_map(val, node.kwargs), out)
    if flops is not None:
        return flops
    return sum(x.numel() for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor))


class Converter:
    """Builds one memplan graph from a forward and a backward FX graph."""

    def __init__(self, name):
        self.name = name
        self.tensors, self.ops = [], []
        self.record = {}  # tensor id -> its record
        self.by_name = {}  # fx value name (forward and backward share saved names)

    def tensor(self, key, val, role="activation", lifetime="transient", view_of=None):
        rec = {"id": key, "size": _nbytes(val), "role": role, "lifetime": lifetime,
               "shape": list(val.shape), "dtype": str(val.dtype).replace("torch.", "")}
        if view_of:
            rec["view_of"] = view_of
        self.tensors.append(rec)
        self.record[key] = rec
        return key

    def graph(self, gm, kind, placeholder):
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                if n.name not in self.by_name:
                    self.by_name[n.name] = placeholder(n)
            elif n.op == "call_function":
                self.call(n, kind)
            elif n.op == "output":
                return n.args[0]

    def call(self, n, kind):
        val = n.meta.get("val")
        if n.target is operator.getitem:
            base = self.by_name.get(n.args[0].name)
            if isinstance(base, list):
                self.by_name[n.name] = base[n.args[1]]
            return
        reads = []
        for a in tree_flatten((n.args, n.kwargs))[0]:
            if isinstance(a, torch.fx.Node) and isinstance(self.by_name.get(a.name), str):
                if self.by_name[a.name] not in reads:
                    reads.append(self.by_name[a.name])
        key = f"{kind}.{n.name}"
        if isinstance(val, torch.Tensor):
            view_of = reads[0] if _is_view(n.target) and reads else None
            outs = [self.tensor(key, val, view_of=view_of)]
            self.by_name[n.name] = outs[0]
        else:
            outs = [self.tensor(f"{key}.{i}", v) if isinstance(v, torch.Tensor) else None
                    for i, v in enumerate(val if isinstance(val, (list, tuple)) else [])]
            self.by_name[n.name] = outs
            outs = [o for o in outs if o]
        if not outs:
            return
        op = {"id": key, "kind": "forward" if kind == "fw" else "backward", "type": str(n.target),
              "inputs": reads, "outputs": outs, "flops": _flops(n, val)}
        self.ops.append(op)

    def mark(self, key, role, lifetime):
        self.record[key]["role"], self.record[key]["lifetime"] = role, lifetime

    def result(self):
        return {"format": "memplan-graph", "version": 1, "name": self.name,
                "tensors": self.tensors, "ops": self.ops}


def to_memplan(fw, bw, name):
    c = Converter(name)
    fw_out = c.graph(fw, "fw", lambda n: c.tensor(f"in.{n.name}", n.meta["val"], "input", "persistent"))
    bw_out = c.graph(bw, "bw", lambda n: c.tensor(f"in.{n.name}", n.meta["val"], "input", "persistent"))
    # The forward's first output is the loss; parameters are the inputs
    # whose gradients the backward returns.
    loss = c.by_name.get(fw_out[0].name)
    if isinstance(loss, str):
        c.mark(loss, "output", "persistent")
    primals = [n for n in fw.graph.nodes if n.op == "placeholder"]
    for p, g in zip(primals, bw_out):
        if g is not None and isinstance(c.by_name.get(g.name), str):
            c.mark(c.by_name[g.name], "gradient", "persistent")
            c.mark(c.by_name[p.name], "parameter", "persistent")
    return c.result()


def total_flops(g):
    return sum(o["flops"] for o in g["ops"])


def memplan_json(binary, *args):
    out = subprocess.run([binary, *args, "--json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="gpt2-tiny", choices=sorted(torch_eager_gpt2.PRESETS))
    ap.add_argument("--layers", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--budgets", type=float, nargs="*", default=[1.0, 0.75, 0.5, 0.25, 0.0],
                    help="PyTorch activation_memory_budget values")
    ap.add_argument("--shares", type=float, nargs="*", default=[0.9, 0.75, 0.6],
                    help="memplan budgets, as shares of its plan without recomputation")
    ap.add_argument("--memplan", default="target/release/memplan")
    ap.add_argument("--time-limit", type=float, default=60)
    ap.add_argument("--keep", help="write the graphs into this folder")
    ap.add_argument("--fake", action="store_true",
                    help="trace on fake tensors (no memory, no arithmetic: how GPT-2 XL fits a "
                         "laptop); the graphs are the ones a real run makes")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    margs = ["--config", a.config, "--device", "cpu"]
    if a.layers:
        margs += ["--layers", str(a.layers)]
    if a.seq:
        margs += ["--seq", str(a.seq)]
    cfg = torch_eager_gpt2.parse_args(margs)
    for k, v in zip(("layers", "width", "heads", "seq", "batch"), torch_eager_gpt2.PRESETS[a.config]):
        if getattr(cfg, k) is None:
            setattr(cfg, k, v)
    with FakeTensorMode(allow_non_fake_inputs=True) if a.fake else contextlib.nullcontext():
        if a.keep:
            os.makedirs(a.keep, exist_ok=True)
            return compare(a, cfg, a.keep)
        # The graphs go to a temporary folder, removed at the end.
        with tempfile.TemporaryDirectory(prefix="torch_remat_compare_") as folder:
            return compare(a, cfg, folder)


def compare(a, cfg, folder):
    torch.manual_seed(0)
    model = torch_eager_gpt2.build(cfg, torch)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))

    def save(name, g):
        path = os.path.join(folder, name + ".json")
        with open(path, "w") as f:
            json.dump(g, f)
        return path

    base = to_memplan(*capture(model, (tokens, tokens), default_partition), f"{a.config}-saved")
    base_path = save("no-recompute", base)
    base_cmp = memplan_json(a.memplan, "compare", base_path)
    step = total_flops(base)

    def fit(budget_bytes):
        try:
            f = memplan_json(a.memplan, "fit", base_path, "--budget", str(budget_bytes),
                             "--minimise", "flops", "--time-limit", str(a.time_limit))
            return {"memplan_arena": f["arena_bytes"], "memplan_added_flops": f["added_flops"]}
        except subprocess.CalledProcessError as e:
            return {"memplan_error": e.stderr.strip().splitlines()[-1] if e.stderr else str(e)}

    # PyTorch's curve: its peak and added FLOPs at each budget, and what
    # memplan adds for the same peak.
    torch_rows = []
    for budget in a.budgets:
        g = to_memplan(*capture(model, (tokens, tokens), min_cut_rematerialization_partition, budget),
                       f"{a.config}-budget-{budget}")
        path = save(f"budget-{budget}", g)
        peak = memplan_json(a.memplan, "compare", path)["baselines"]["program-order"]["footprint_bytes"]
        row = {"activation_memory_budget": budget, "torch_peak": peak,
               "torch_added_flops": total_flops(g) - step, **fit(peak)}
        torch_rows.append(row)
        print(json.dumps(row), flush=True)
    # memplan's targets: shares of its plan without recomputation, and the
    # cheapest PyTorch setting that reaches each.
    target_rows = []
    for share in a.shares:
        target = int(base_cmp["peak_bytes"] * share)
        reach = [r for r in torch_rows if r["torch_peak"] <= target]
        best = min(reach, key=lambda r: r["torch_added_flops"]) if reach else None
        row = {"share": share, "target": target, **fit(target),
               "torch_best_budget": best and best["activation_memory_budget"],
               "torch_added_flops": best and best["torch_added_flops"]}
        target_rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {"config": a.config, "layers": cfg.layers, "seq": cfg.seq, "batch": cfg.batch,
               "step_flops": step,
               "no_recompute_program_order_peak": base_cmp["baselines"]["program-order"]["peak_bytes"],
               "no_recompute_memplan_peak": base_cmp["peak_bytes"],
               "torch_curve": torch_rows, "memplan_targets": target_rows}
    if a.json:
        print(json.dumps(summary, indent=1))
    else:
        print_tables(summary)
    return summary


def print_tables(s):
    step = s["step_flops"]
    pct = lambda x: f"{100 * x / step:.2f}%"  # noqa: E731
    def mem(r):
        if "memplan_arena" in r:
            return f"{r['memplan_arena']:,} | {pct(r['memplan_added_flops'])}"
        why = r["memplan_error"]
        floor = why.split("needs at least ")[-1].split(":")[0] if "needs at least" in why else why
        return f"refused: needs at least {floor} | –"

    print(f"{s['config']} (layers {s['layers']}, seq {s['seq']}, batch {s['batch']}): step {step:.4g} FLOPs; "
          f"no recomputation: PyTorch's order {s['no_recompute_program_order_peak']:,} B, "
          f"memplan {s['no_recompute_memplan_peak']:,} B")
    print("\n| activation_memory_budget | PyTorch peak | PyTorch +FLOPs | memplan arena at that peak | memplan +FLOPs |")
    print("|---:|---:|---:|---:|---:|")
    for r in s["torch_curve"]:
        print(f"| {r['activation_memory_budget']} | {r['torch_peak']:,} | {pct(r['torch_added_flops'])} | {mem(r)} |")
    print("\n| memplan budget | bytes | memplan arena | memplan +FLOPs | cheapest PyTorch budget reaching it | PyTorch +FLOPs |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in s["memplan_targets"]:
        t = (f"{r['torch_best_budget']} | {pct(r['torch_added_flops'])}" if r["torch_best_budget"] is not None
             else "none reaches it | –")
        print(f"| {100 * r['share']:.0f}% | {r['target']:,} | {mem(r)} | {t} |")


if __name__ == "__main__":
    main()
