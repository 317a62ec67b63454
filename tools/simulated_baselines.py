"""Issue 39's simulated targets on Hugging Face models too large for this
machine: each step captured on the meta device (nothing runs), then
`memplan compare` simulates the eager configurations on the captured graph
(the caching allocator with and without expandable segments, the optimizer
in the backward pass) and `memplan fit` fits it.

    PYTHONPATH=python .venv/bin/python tools/simulated_baselines.py [--models gpt2-xl,llama-1b] [--json]

Per model, three captured steps: plain, op-level selective activation
checkpointing and full per-block checkpointing (as
`benchmarks.bench_baselines` configures them). The best eager
configuration is the smallest simulated reserved peak over every eager key
of every step: the caching allocator with and without expandable segments,
each also with the optimizer in the backward pass (on a checkpointed step
that is torchtune's combination of activation checkpointing and
`optimizer_in_bwd`). memplan's sides: the plan of the plain
step, its fit at 0.1% more FLOPs, and its fit to each checkpointing side's
least simulated peak (of its four configurations), whose added FLOPs are
set beside the checkpointing side's
(FLOPs counted on the captured graphs: matrix products and attention,
for memplan's fits those the graph records for the ops run again; the
share each fit kept to, of its cost model, which prices elementwise ops
too, is `cost_model_added_share`). Beside the fits within 0.1%, `floor GiB`
is the floor of every recomputation within that share, in any order
(`share_floor_bytes`, docs/fit.md): how far the fit is from the best
possible.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

EAGER_KEYS = ("pytorch-reserved", "pytorch-expandable-segments", "eager-optimizer-in-backward",
              "eager-optimizer-in-backward-expandable-segments")


def models():
    """name -> (make the model on the meta device, batch, loss function, description),
    from memplan.torch's one catalogue of shapes."""
    from memplan.torch.export.workloads import hf_gpt2, hf_llama, lm_loss, lm_loss_bf16

    def on_meta(build, shape):
        def make():
            with torch.device("meta"):
                return build(shape).train()
        return make

    return {
        "gpt2-tiny": (on_meta(hf_gpt2, "tiny-64"), torch.zeros((2, 64), dtype=torch.long), lm_loss,
                      "GPT-2, 2 layers, width 64, b2 × 64, f32"),
        "gpt2-xl": (on_meta(hf_gpt2, "xl"), torch.zeros((1, 1024), dtype=torch.long), lm_loss,
                    "GPT-2 XL, b1 × 1024, f32"),
        "llama-1b": (on_meta(hf_llama, "1b"), torch.zeros((1, 2048), dtype=torch.long), lm_loss_bf16,
                     "Llama 3.2 1B shape, b1 × 2048, bf16 autocast over f32 parameters"),
    }


def _capture(make, batch, loss_fn, side: str):
    """The captured step (not planned) of `side`'s configuration."""
    import memplan.torch as mt
    from benchmarks.baselines import configured

    model = configured(make, "eager-" + side)  # (plain: "eager-plain", no checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    return mt.capture(model, opt, batch, loss_fn, plan=False)


def _split_then_fit(step, time_limit: float, plain_flops: float) -> dict:
    """The plain step with its loss split (`split_loss("auto")`, kept only
    where it lowers the plan) and then fitted within 0.1% more FLOPs, the
    split's own FLOPs counted in that share: through `memplan.torch`,
    which splits captured (aten) steps; `memplan fit --split` splits the
    built-in vocabulary's ops only."""
    step.split_loss("auto", time_limit)
    f = step.fit(max_added=0.001, minimise="flops", time_limit=time_limit)
    from benchmarks.baselines import flops_of

    split_added = f.get("split_added_flops", 0)
    # The share the fit kept to is of the step as captured: the fitted
    # step's FLOPs (the core's cost model, as `memplan fit` counts them)
    # less the split's.
    share = (f["added_flops"] + split_added) / (f["step_flops"] - split_added)
    # In the checkpointing sides' unit: what the split step records for the
    # ops run again, with the split's own additions.
    counted = (flops_of(step.graph, f["recomputed_ops"]) + split_added) / plain_flops
    return {"peak_bytes": f["arena_bytes"], "added_flops_share": counted, "cost_model_added_share": share,
            "chunks": step.split["chunks"], "share_floor_bytes": f.get("share_floor_bytes")}


def _memplan(binary: str, *args: str) -> dict:
    out = subprocess.run([binary, *args, "--json"], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"memplan {' '.join(args)}: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout)


def _flops(graph) -> float:
    return float(sum(float(op.get("flops", 0)) for op in graph["ops"]))


def measure(name: str, binary: str, time_limit: float, d: str) -> dict:
    make, batch, loss_fn, what = models()[name]
    r: dict = {"model": what, "sides": {}}
    paths, flops = {}, {}
    plain_step = None
    for side in ("plain", "selective-ac", "full-ac"):
        t0 = time.perf_counter()
        step = _capture(make, batch, loss_fn, side)
        g = step.graph
        if side == "plain":
            plain_step = step
        r.setdefault("capture_seconds", {})[side] = time.perf_counter() - t0
        paths[side] = os.path.join(d, f"{name}-{side}.json")
        with open(paths[side], "w") as f:
            json.dump(g, f)
        flops[side] = _flops(g)
        c = _memplan(binary, "compare", paths[side], "--time-limit", str(time_limit))
        # Every key on every step: on a checkpointed one, the optimizer in
        # the backward is torchtune's combination with checkpointing.
        for k in EAGER_KEYS:
            row = {"peak_bytes": c["baselines"][k]["footprint_bytes"]}
            if side != "plain":
                row["added_flops_share"] = flops[side] / flops["plain"] - 1
            r["sides"][f"{side}/{k}"] = row
        if side == "plain":
            r["sides"]["memplan"] = {"peak_bytes": c["arena_bytes"], "lower_bound_bytes": c["lower_bound_bytes"]}
        r.setdefault("ops", {})[side] = c["ops"]
    best = min((k for k in r["sides"] if "/" in k), key=lambda k: r["sides"][k]["peak_bytes"])
    r["best_eager"] = best
    from benchmarks.baselines import flops_of

    def added(f) -> dict:
        """A fit's added FLOPs as the checkpointing sides' are counted (what
        the captured graph records for the ops run again), and as its cost
        model counts them (elementwise ops too; the unit of its share)."""
        return {"added_flops_share": flops_of(plain_step.graph, f["recomputed_ops"]) / flops["plain"],
                "cost_model_added_share": f["added_flops"] / f["step_flops"]}

    f = _memplan(binary, "fit", paths["plain"], "--max-added", "0.1%", "--minimise", "flops",
                 "--time-limit", str(time_limit))
    r["sides"]["memplan-fit-0.1%"] = {"peak_bytes": f["arena_bytes"], **added(f),
                                      "share_floor_bytes": f["share_floor_bytes"]}
    for side in ("selective-ac", "full-ac"):
        target = min(r["sides"][f"{side}/{k}"]["peak_bytes"] for k in EAGER_KEYS)
        try:
            f = _memplan(binary, "fit", paths["plain"], "--budget", str(target), "--minimise", "flops",
                         "--time-limit", str(time_limit))
            r["sides"][f"memplan-fit@{side}"] = {"peak_bytes": f["arena_bytes"], "budget_bytes": target, **added(f)}
        except RuntimeError as e:
            r["sides"][f"memplan-fit@{side}"] = {"error": str(e), "budget_bytes": target}
    r["sides"]["memplan-split-fit-0.1%"] = _split_then_fit(plain_step, time_limit, flops["plain"])
    return r


def report(name: str, r: dict) -> str:
    gib = 2 ** 30
    best = r["sides"][r["best_eager"]]["peak_bytes"]
    lines = [f"{name} ({r['model']}; {r['ops']['plain']:,} ops): simulated peaks, against the best eager "
             f"configuration ({r['best_eager']})",
             f"{'side':60} {'GiB':>8} {'vs best':>8} {'added FLOPs':>12} {'cost model':>11} {'floor GiB':>10}"]
    for side, row in r["sides"].items():
        if "error" in row:
            lines.append(f"{side:60} {'':>8} {'':>8} {'':>12}  ({row['error'][:120]})")
            continue
        added = row.get("added_flops_share")
        model = row.get("cost_model_added_share")
        floor = row.get("share_floor_bytes")
        lines.append(f"{side:60} {row['peak_bytes'] / gib:8.3f} {100 * (row['peak_bytes'] / best - 1):+7.1f}% "
                     f"{'' if added is None else f'{100 * added:.3f}%':>12} "
                     f"{'' if model is None else f'{100 * model:.3f}%':>11} "
                     f"{'' if floor is None else f'{floor / gib:.3f}':>10}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2-xl,llama-1b")
    ap.add_argument("--memplan", default="target/release/memplan", help="the memplan binary")
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name in args.models.split(","):
            out[name] = measure(name, args.memplan, args.time_limit, d)
            if not args.json:
                print(report(name, out[name]), flush=True)
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
