#!/usr/bin/env python3
"""Runs Moccasin (CP-SAT rematerialization, ICML 2023) on the Checkmate
graphs in fixtures/checkmate, at the budgets its paper uses, and records
what it finds: the reference `memplan fit` is compared with
(examples/checkmate_fit.rs, docs/fit.md).

Moccasin is not a dependency of memplan (it is GPL-3.0 and needs OR-Tools):
give this script a checkout of https://github.com/haoming-codes/moccasin and
a Python with `ortools` and `networkx`. Moccasin's `remat` is called as the
repository's own main.py calls it (C=2 computations per node, stage
domains, the budget a share of the peak of networkx's topological order).
Its `rockmate` import is only used to export schedules and is stubbed.

    .venv/bin/pip install ortools networkx
    .venv/bin/python tools/moccasin_reference.py --moccasin /path/to/moccasin \
        --timeout 60 -o fixtures/checkmate/moccasin.json
"""

import argparse
import gzip
import json
import math
import os
import sys
import tempfile
import time
import types

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "checkmate")
GRAPHS = ["vgg16", "vgg19", "fcn8", "segnet", "unet", "mobilenet", "resnet50"]


def import_moccasin(checkout, workers):
    stub = types.ModuleType("rockmate.def_op")
    stub.RunOp = stub.DelOp = stub.OpSchedule = object
    sys.modules.setdefault("rockmate", types.ModuleType("rockmate"))
    sys.modules["rockmate.def_op"] = stub
    sys.path.insert(0, os.path.join(checkout, "src"))
    from moccasin import cp, util  # noqa: E402
    from ortools.sat.python import cp_model

    class Solver(cp_model.CpSolver):
        """CP-SAT with the worker count of this machine, not Moccasin's 16."""

        def _workers(self):
            if workers:
                self.parameters.num_search_workers = workers

        def Solve(self, *a, **k):  # noqa: N802 (OR-Tools' name)
            self._workers()
            return super().Solve(*a, **k)

        def SolveWithSolutionCallback(self, *a, **k):  # noqa: N802
            self._workers()
            return super().SolveWithSolutionCallback(*a, **k)

    cp.cp_model.CpSolver = Solver
    return cp, util


def load(name):
    import networkx as nx

    with gzip.open(os.path.join(FIXTURES, name + ".json.gz"), "rt") as f:
        data = json.load(f)
    return nx.node_link_graph(data, directed=True, multigraph=False, edges="links")


def run_one(cp, util, name, share, timeout, log_dir):
    import networkx as nx

    g = load(name)
    order = list(nx.topological_sort(g))
    topo_mem, topo_cpu = util.get_mem_from_schedule(g, order)
    budget = math.ceil(topo_mem * share)
    t0 = time.perf_counter()
    r = cp.remat(
        G=g, B=budget, C=2, timeout=timeout, discretized=True, reservoir=True,
        use_end_global=False, use_stage=True, topo_order=order, phase1=True,
        use_interval_length_domain=True, use_gcd=True, reservoir_option=2,
        log_dir=log_dir,
    )
    wall = time.perf_counter() - t0
    row = {
        "graph": name, "share": share, "budget": budget, "topo_mem": topo_mem,
        "topo_cost": topo_cpu, "status": r.get("status"), "wall_s": round(wall, 2),
        "timeout_per_phase_s": timeout,
    }
    if "obj_val" in r:
        row["cost"] = r["obj_val"]
        row["added"] = r["obj_val"] / topo_cpu - 1
        row["peak"] = r["mem_schedule"]
        # when the last improvement was found (phase 2 clock)
        sols = sorted(r.get("solns", {}).values(), key=lambda d: d["time"])
        if sols:
            row["last_improvement_s"] = round(sols[-1]["time"], 2)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moccasin", required=True, help="path of a Moccasin checkout")
    ap.add_argument("--timeout", type=float, default=60, help="CP-SAT limit per phase, s")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="CP-SAT workers")
    ap.add_argument("--graphs", nargs="*", default=GRAPHS)
    ap.add_argument("--shares", nargs="*", type=float, default=[0.9, 0.8])
    ap.add_argument("-o", "--output", help="write the rows as JSON here")
    a = ap.parse_args()
    cp, util = import_moccasin(a.moccasin, a.workers)
    rows = []
    output = os.path.abspath(a.output) if a.output else None
    with tempfile.TemporaryDirectory() as log_dir:
        # Moccasin writes its solution log into the working directory.
        os.chdir(log_dir)
        for name in a.graphs:
            for share in a.shares:
                row = run_one(cp, util, name, share, a.timeout, log_dir)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if output:
        meta = {
            "tool": "Moccasin (github.com/haoming-codes/moccasin), via tools/moccasin_reference.py",
            "timeout_per_phase_s": a.timeout, "workers": a.workers,
            "machine_cpus": os.cpu_count(),
        }
        with open(output, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
