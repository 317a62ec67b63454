"""Per-rank memory of a data-parallel (DDP) or sharded (FSDP2, ``--fsdp``)
training step on the CPU: eager PyTorch against memplan's captured step,
measured with real ranks (gloo).

    python -m benchmarks.bench_distributed --world 2 --layers 4 --hidden 512 --seq 512

starts `--world` processes on this machine (one rank each, a free port) and
prints, from rank 0, each side's per-rank peak for one Hugging Face Llama
step (random weights, AdamW, each rank its own batch):

- ``eager-ddp``: ``loss.backward(); optimizer.step(); zero_grad()`` on
  ``DistributedDataParallel(model)``;
- ``eager-ddp-bucket-view``: the same with ``gradient_as_bucket_view=True``
  (the gradients are views of DDP's buckets: no second copy);
- ``memplan``: the captured step in memplan's order
  (:mod:`memplan.torch._distributed`);
- ``memplan-fit-0.1%``: the step fitted by recomputation to the smallest
  memplan finds for at most 0.1% more FLOPs.

With ``--fsdp`` the model is sharded with ``fully_shard`` on each decoder
block, then the root, and the sides are ``fsdp2-eager``, ``memplan`` and
``memplan-fit-0.1%`` (FSDP2 holds no buckets); ``--mixed-precision`` gives
every unit torchtitan's ``MixedPrecisionPolicy`` (bf16 parameters, float32
reduction). ``--checkpoint`` checkpoints every decoder block on every side
(Hugging Face's ``gradient_checkpointing_enable``, non-reentrant).

Every figure is the allocator's: the bytes of the tensors held before and
after the step (parameters, optimizer state, the batch) plus the highest
running sum of the allocator's events during the step
(:func:`memplan.torch._run.allocator_peak`), plus the bytes of DDP's
buckets, which the wrapper allocates when it is made and holds for good
(``_get_ddp_logging_data()["bucket_sizes"]``). memplan's step never uses
those buckets, but a model wrapped with DDP keeps them, so they are counted
on both sides. Each side runs one step unmeasured (it makes the optimizer
state, and DDP rebuilds its buckets there), then ``--steps`` measured
ones; a side's peak is the lowest of them (all are listed). On gloo an
eager step's peak varies from step to step: gloo's worker thread lets go
of a collective's buffers late now and then (FSDP2's flat all-gather
buffer beside the next one), so the lowest is the eager figure without
that accident; memplan's steps wait for the release and agree.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

from . import child_env

SIDES = ("eager-ddp", "eager-ddp-bucket-view", "memplan", "memplan-fit-0.1%")
FSDP_SIDES = ("fsdp2-eager", "memplan", "memplan-fit-0.1%")


def _torchtitan_model(args):
    """torchtitan's own Llama 3 (its registry's flavor, --layers and
    --hidden overriding its depth and width; init_weights as its trainer
    runs it), checkpointed with its own apply_ac when --ac asks."""
    import copy

    import torch
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3 import Transformer, llama3_args

    torch.manual_seed(0)
    a = copy.deepcopy(llama3_args[args.torchtitan])
    if args.layers is not None:
        a.n_layers = args.layers
    if args.hidden is not None:
        a.dim, a.n_heads = args.hidden, max(1, args.hidden // 64)
    a.max_seq_len = args.seq
    model = Transformer(a)
    with torch.no_grad():
        model.init_weights()
    if args.ac != "none":
        apply_ac(model, ActivationCheckpoint(mode=args.ac))
    return model


def _model(args):
    import torch
    import transformers as T

    if args.torchtitan:
        return _torchtitan_model(args)

    torch.manual_seed(0)
    heads = args.heads or max(1, args.hidden // 64)
    cfg = T.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                        intermediate_size=args.intermediate or args.hidden * 8 // 3, num_hidden_layers=args.layers,
                        num_attention_heads=heads, num_key_value_heads=args.kv_heads or max(1, heads // 2),
                        max_position_embeddings=args.seq, tie_word_embeddings=args.tied)
    model = T.LlamaForCausalLM(cfg).train()
    if getattr(args, "checkpoint", False):  # each decoder block recomputed in the backward, on every side
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _shard(args, model) -> None:
    """torchtitan's wrapping: ``fully_shard`` on each decoder block, then
    the root; with ``--mixed-precision`` its policy (bf16 parameters,
    float32 reduction)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if args.torchtitan:  # torchtitan's own wrapping (and its summed gradients)
        from torch.distributed.device_mesh import init_device_mesh
        from torchtitan.models.llama3.infra.parallelize import apply_fsdp

        mesh = init_device_mesh(args.device, (args.world,), mesh_dim_names=("dp_shard",))
        apply_fsdp(model, mesh, param_dtype=torch.bfloat16 if args.mixed_precision else torch.float32,
                   reduce_dtype=torch.float32, pp_enabled=False)
        return
    kw = {}
    if args.mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def _loss(m, b):
    return m(input_ids=b, labels=b).loss


class _TorchtitanLoss:
    """torchtitan's loss: its cross-entropy (a sum over this rank's
    tokens) divided by the global token count, on batches of seq + 1
    tokens (inputs, then labels shifted by one)."""

    def __init__(self, global_tokens: int) -> None:
        self.global_tokens = global_tokens

    def __call__(self, m, b):
        from torchtitan.components.loss import cross_entropy_loss

        return cross_entropy_loss(m(b[:, :-1]), b[:, 1:]) / self.global_tokens


def _bf16_loss(m, b):
    import torch

    with torch.autocast(b.device.type, dtype=torch.bfloat16):
        return m(input_ids=b, labels=b).loss


def _without_ranks(args) -> Dict[str, Any]:
    """One rank's FSDP2 step planned in this process alone: the model on
    the meta device, PyTorch's fake process group of `--world` ranks."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import memplan
    import memplan.torch as mt

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    with torch.device("meta"):
        model = _model(args)
    _shard(args, model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    step = mt.capture(model, opt, torch.zeros((args.batch, args.seq), dtype=torch.long),
                      _bf16_loss if args.autocast else _loss, plan=False)
    t1 = time.perf_counter()
    # FSDP2 eager on the same captured graph (as written: eager does not
    # split), its order rebuilt from the collectives' units, on CUDA.
    graphs = {"captured": step.graph}
    if args.split is not None:
        step.split_loss(args.split if args.split == "auto" else int(args.split), time_limit=args.time_limit)
    else:
        step.make_plan(time_limit=args.time_limit)
    t2 = time.perf_counter()
    st = step.stats
    out = {"ops": st["ops"], "capture_seconds": t1 - t0, "plan_seconds": t2 - t1,
           "max_live_bytes": st["max_live_bytes"], "lower_bound_bytes": st["lower_bound_bytes"],
           "arena_bytes": st["arena_bytes"]}
    if step.split is not None:
        out["split"] = {k: step.split[k] for k in ("chunks", "tried", "added_flops")}
    if step.split is not None and step.split["chunks"] > 1:
        graphs["split"] = step.graph  # eager running the split step (a loss chunked by hand)
    for name, graph in graphs.items():
        b = memplan.baselines(graph, "cuda")
        key = "baselines" if name == "captured" else "split_baselines"
        out[key] = {k: v["footprint_bytes"] for k, v in b["baselines"].items()}
        out["best_eager" if name == "captured" else "split_best_eager"] = b["best_eager"]
    return out


def _bucket_bytes(ddp) -> int:
    sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
    return sum(int(s) for s in str(sizes).split(",") if s.strip())


def _state(opt) -> List[Any]:
    return [v for s in opt.state.values() for v in s.values()]


def _wrapped(args, side):
    """The model as the side runs it: DDP, or FSDP2 on each block then the
    root (torchtitan's wrapping)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model(args).to(args.device)
    if not args.fsdp:
        return DDP(model, gradient_as_bucket_view=(side == "eager-ddp-bucket-view"))
    _shard(args, model)
    return model


def _rank(args) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    import memplan
    import memplan.torch as mt
    from memplan.torch._capture import local_tensor
    from memplan.torch._run import allocator_peak

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = args.seq + (1 if args.torchtitan else 0)
    batches = [torch.randint(0, args.vocab, (args.batch, tokens), generator=g).to(args.device) for _ in range(2)]
    cuda = args.device != "cpu"
    loss_fn = _TorchtitanLoss(args.world * args.batch * args.seq) if args.torchtitan else \
        _bf16_loss if args.autocast else _loss
    clip = 1.0 if args.torchtitan else None  # torchtitan clips at 1.0 by default
    out: Dict[str, Any] = {}
    for side in (FSDP_SIDES if args.fsdp else SIDES):
        ddp = _wrapped(args, side)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        s = None
        if "eager" in side:
            if args.torchtitan and not cuda:
                _force_sums(ddp)  # gloo has no PREMUL_SUM: the same sum

            def step(b, ddp=ddp, opt=opt):
                loss_fn(ddp, b).backward()
                if clip is not None:
                    from torchtitan.distributed import utils as dist_utils

                    dist_utils.clip_grad_norm_(list(ddp.parameters()), clip, foreach=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            s = mt.capture(ddp, opt, batches[0], loss_fn, time_limit=args.time_limit, clip_grad_norm=clip)
            row = {"max_live_bytes": s.plan["stats"]["max_live_bytes"],
                   "lower_bound_bytes": s.plan["stats"]["lower_bound_bytes"]}
            if args.fsdp and side == "memplan":
                # FSDP2 eager simulated on the captured graph (its order rebuilt:
                # memplan.baselines), to set against the real fsdp2-eager row.
                b = memplan.baselines(s.graph, "cuda" if cuda else "cpu")["baselines"]
                row["simulated_eager"] = {k: b[k]["footprint_bytes"] for k in
                                          ("program-order", "pytorch-allocated", "pytorch-reserved")}
            if side == "memplan-fit-0.1%":
                f = s.fit(max_added=0.001, minimise="flops", time_limit=args.time_limit)
                row.update(max_live_bytes=s.plan["stats"]["max_live_bytes"],
                           added_flops_share=f["added_flops"] / f["step_flops"])
            out[side] = row

            def step(b, s=s):
                s(b, arena=args.arena)
            if args.arena:
                row["arena_bytes"] = s.plan["arena_bytes"]
        step(batches[0])
        dist.barrier()
        resident = [local_tensor(x) for x in list(ddp.parameters()) + _state(opt)] + [batches[1]]
        if not "eager" in side:
            resident += list(s._bound.values())  # the step's constants (held between steps) too
            if args.arena:  # the arena once, not again the tensors living in it
                buf = s.place().buffer
                lo, hi = buf.data_ptr(), buf.data_ptr() + buf.untyped_storage().nbytes()
                resident = [x for x in resident if not lo <= x.untyped_storage().data_ptr() < hi] + [buf]
        buckets = 0 if args.fsdp else _bucket_bytes(ddp)
        row = out.setdefault(side, {})
        peaks, reserved, seconds = [], [], []
        for _ in range(args.steps):
            if cuda:  # the caching allocator's own figures (buckets are allocated on the device: counted)
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                step(batches[1])
                torch.cuda.synchronize()
                seconds.append(time.perf_counter() - t0)
                reserved.append(torch.cuda.max_memory_reserved())
                peaks.append(torch.cuda.max_memory_allocated())
            else:
                peaks.append(allocator_peak(lambda: step(batches[1]), resident) + buckets)
            dist.barrier()
        if cuda:
            row.update(step_seconds=sorted(seconds)[len(seconds) // 2], reserved_bytes=min(reserved))
        # Every side computed the same steps: a digest of this rank's shards to compare.
        row["parameter_norms"] = [float(local_tensor(p).detach().double().norm()) for p in ddp.parameters()]
        if cuda and args.arena and "eager" not in side:
            # What this rank allocates outside its arena during one more step
            # (after the digest: it changes the parameters), by op, most first.
            from .bench import _outside_by_op

            try:
                here = torch.device("cuda", torch.cuda.current_device())
                row["outside_ops"] = _outside_by_op(lambda: step(batches[1]), here)
            except Exception as e:  # noqa: BLE001 - a report, not the measurement: say why it is missing
                row["outside_ops_error"] = f"{type(e).__name__}: {e}"
            dist.barrier()
        row.update(peak_bytes=min(peaks), peak_bytes_per_step=peaks, bucket_bytes=buckets,
                   resident_bytes=sum(x.untyped_storage().nbytes() for x in resident))
        dist.barrier()
        ddp = opt = step = s = None  # this side's memory goes before the next side's is made
    return out


def _force_sums(model) -> None:
    """FSDP2 eager on gloo cannot reduce with torchtitan's divide factor
    (NCCL's PREMUL_SUM): every unit sums instead, the same sum (factor 1)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def _precision(args) -> str:
    return ((", bf16 autocast" if args.autocast else "")
            + (", MixedPrecisionPolicy(bf16, reduce float32)" if args.mixed_precision else "")
            + (", every block checkpointed" if args.checkpoint else ""))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_distributed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks (processes), default 2")
    ap.add_argument("--layers", type=int, help="decoder blocks (default 4; with --torchtitan the flavor's)")
    ap.add_argument("--hidden", type=int, help="model width (default 512; with --torchtitan the flavor's)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds for the plan and the fit, each")
    ap.add_argument("--steps", type=int, default=3,
                    help="measured steps per side after the first (default 3); a side's peak is their lowest")
    ap.add_argument("--split", default=None, help="with --without-ranks: split the loss chain (auto or a number "
                    "of chunks; capture(split=...))")
    ap.add_argument("--intermediate", type=int, help="MLP width (default 8/3 of --hidden)")
    ap.add_argument("--heads", type=int, help="attention heads (default hidden/64)")
    ap.add_argument("--kv-heads", type=int, help="key-value heads (default half the heads)")
    ap.add_argument("--arena", action="store_true",
                    help="memplan's steps in their arena (each rank's tensors at their planned offsets in one buffer)")
    ap.add_argument("--tied", action="store_true", help="the output head shares the embedding's weight")
    ap.add_argument("--autocast", action="store_true", help="the forward under bf16 autocast")
    ap.add_argument("--checkpoint", action="store_true",
                    help="activation checkpointing of every decoder block (Hugging Face's, "
                         "use_reentrant=False) on every side")
    ap.add_argument("--mixed-precision", action="store_true",
                    help="with --fsdp: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32) on every unit")
    ap.add_argument("--without-ranks", action="store_true",
                    help="plan one rank's FSDP2 step in this process: a meta-device model and PyTorch's fake "
                         "process group of --world ranks (nothing runs)")
    ap.add_argument("--fsdp", action="store_true",
                    help="shard with FSDP2 (fully_shard on each block, then the root) instead of DDP")
    ap.add_argument("--torchtitan", metavar="FLAVOR",
                    help="torchtitan's own Llama 3 (e.g. debugmodel), wrapped by its apply_fsdp (summed gradients), "
                         "its loss (sum over tokens / global tokens) and clipping at 1.0 (implies --fsdp)")
    ap.add_argument("--ac", default="none", choices=("none", "selective", "full"),
                    help="with --torchtitan: torchtitan's apply_ac on every side")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: one GPU per rank (rank r on GPU r), NCCL, the peaks from torch.cuda.max_memory_*")
    ap.add_argument("--json", action="store_true", help="print rank 0's figures as JSON")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before every rank is stopped")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.world < 1:
        ap.error("--world must be at least 1")
    if args.torchtitan:
        if args.without_ranks or args.autocast or args.checkpoint or args.tied:
            ap.error("--torchtitan takes its model's own settings: give no --without-ranks, --autocast, "
                     "--checkpoint or --tied (--ac checkpoints as torchtitan does)")
        args.fsdp = True
        from torchtitan.models.llama3 import llama3_args

        if args.torchtitan not in llama3_args:
            ap.error(f"--torchtitan {args.torchtitan}: torchtitan's Llama 3 flavors are {', '.join(llama3_args)}")
        args.vocab = llama3_args[args.torchtitan].vocab_size
    elif args.ac != "none":
        ap.error("--ac is torchtitan's activation checkpointing: give it with --torchtitan")
    if not args.torchtitan:
        args.layers = 4 if args.layers is None else args.layers
        args.hidden = 512 if args.hidden is None else args.hidden
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if args.device == "cuda" and not args.without_ranks:
        import torch

        shared = os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"  # NCCL 2.30+: ranks may share a GPU
        if torch.cuda.device_count() < (1 if shared else args.world):
            ap.error(f"--device cuda puts each rank on its own GPU: --world {args.world} needs {args.world} GPUs, "
                     f"this machine has {torch.cuda.device_count()} (NCCL refuses two ranks on one GPU)")
    if args.mixed_precision and not args.fsdp and not args.without_ranks:
        ap.error("--mixed-precision is FSDP2's MixedPrecisionPolicy: give it with --fsdp or --without-ranks")
    if args.without_ranks:
        r = _without_ranks(args)
        if args.json:
            print(json.dumps(r, indent=1))
        else:
            _print_without_ranks(args, r)
        return 0
    if args.rank is not None:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=args.port)
        if args.device == "cuda":
            torch.cuda.set_device(args.rank % torch.cuda.device_count())
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=args.rank, world_size=args.world,
                                timeout=datetime.timedelta(seconds=args.timeout))
        result = _rank(args)
        with open(args.out, "w") as f:
            json.dump(result, f)
        os._exit(0)
    rows = _spawn_ranks(args, argv)
    if rows is None:
        return 1
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    _print_rows(args, rows)
    return 0


def _print_without_ranks(args, r) -> None:
    """The summary of one rank's FSDP2 step planned without ranks."""
    gib = 2 ** 30
    print(f"HF Llama, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, seq {args.seq}, batch "
          f"{args.batch} per rank, f32 parameters{_precision(args)}, AdamW, "
          f"FSDP2 over W={args.world} (fake process group, meta device): {r['ops']:,} ops, capture "
          f"{r['capture_seconds']:.1f} s, plan {r['plan_seconds']:.1f} s; per rank: max live "
          f"{r['max_live_bytes'] / gib:.2f} GiB, lower bound {r['lower_bound_bytes'] / gib:.2f} GiB, arena "
          f"{r['arena_bytes'] / gib:.2f} GiB")
    if "split" in r:
        sp = r["split"]
        print(f"loss chain split in {sp['chunks']} chunks (tried: "
              + ", ".join(f"{t['chunks']}: {t['arena_bytes'] / gib:.2f} GiB" for t in sp["tried"])
              + f"), {sp['added_flops']:,} FLOPs added")
    keys = ("pytorch-reserved", "pytorch-expandable-segments", "eager-optimizer-in-backward",
            "eager-optimizer-in-backward-expandable-segments")
    for what, bk, ek in (("the same captured graph", "baselines", "best_eager"),
                         ("the split graph (eager with the loss chunked as memplan splits it)",
                          "split_baselines", "split_best_eager")):
        if bk not in r:
            continue
        base, best = r[bk], r[ek]
        print(f"FSDP2 eager simulated on {what} (CUDA's prefetch, memplan.baselines): "
              + ", ".join(f"{k} {base[k] / gib:.2f} GiB" for k in keys))
        print(f"  memplan's arena is {100 * (1 - r['arena_bytes'] / base[best]):.1f}% below the best eager "
              f"configuration ({best}), {100 * (1 - r['arena_bytes'] / base['pytorch-reserved']):.1f}% "
              "below the default allocator (pytorch-reserved)")


def _spawn_ranks(args, argv):
    """Runs the bench in `args.world` processes (this command again, with
    each its rank); returns rank 0's rows, or None when a rank failed or
    the ranks ran past `args.timeout`."""
    port = str(_free_port())
    with tempfile.TemporaryDirectory() as d:
        outs = [os.path.join(d, f"{r}.json") for r in range(args.world)]
        cmd = [sys.executable, "-m", "benchmarks.bench_distributed"] + (argv if argv is not None else sys.argv[1:])
        procs = [subprocess.Popen(cmd + ["--rank", str(r), "--port", port, "--out", outs[r]],
                                  env=child_env(dict(os.environ, OMP_NUM_THREADS="1")))
                 for r in range(args.world)]
        try:
            codes = [p.wait(timeout=args.timeout) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            print(f"stopped after {args.timeout:g} s", file=sys.stderr)
            return None
        if any(codes) or not all(os.path.exists(o) for o in outs):
            print(f"a rank failed (exit codes {codes})", file=sys.stderr)
            return None
        with open(outs[0]) as f:
            rows = json.load(f)
    return rows


def _print_rows(args, rows) -> None:
    """The per-side table of rank 0's figures."""
    mib = 2 ** 20
    sides = FSDP_SIDES if args.fsdp else SIDES
    where = "NCCL, CUDA: torch.cuda.max_memory_allocated" if args.device == "cuda" else "gloo, CPU"
    what = (f"torchtitan Llama 3 {args.torchtitan} (its apply_fsdp, AC {args.ac}, clipping at 1.0)"
            if args.torchtitan else "HF Llama")
    flavor = "the flavor's"
    print(f"{what}, {args.layers or flavor} layers, hidden {args.hidden or flavor}, vocab {args.vocab}, seq {args.seq}, "
          f"batch {args.batch} per rank, f32 parameters{_precision(args)}, AdamW, W={args.world} ({where}); per-rank "
          "bytes of rank 0")
    print(f"{'side':24} {'peak':>10} {'buckets':>9} {'plan max live':>14} {'vs ' + sides[0]:>13}")
    base = rows[sides[0]]["peak_bytes"]
    for side in sides:
        r = rows[side]
        live = f"{r['max_live_bytes'] / mib:11.1f}M" if "max_live_bytes" in r else ""
        print(f"{side:24} {r['peak_bytes'] / mib:9.1f}M {r['bucket_bytes'] / mib:8.1f}M {live:>14} "
              f"{100 * (r['peak_bytes'] / base - 1):+12.1f}%")
    norms = {side: rows[side]["parameter_norms"] for side in sides}
    for side in sides[1:]:
        d = max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(norms[side], norms[sides[0]])), default=0.0)
        print(f"{side}: parameter shards after {1 + args.steps} steps within {d:.2e} (relative norm) of {sides[0]}'s")
    if args.device == "cuda":
        for side in sides:
            r = rows[side]
            print(f"{side}: reserved {r['reserved_bytes'] / mib:.1f}M, step {1000 * r['step_seconds']:.1f} ms (median)"
                  + (f", arena {r['arena_bytes'] / mib:.1f}M" if "arena_bytes" in r else ""))
            if "arena_bytes" in r:
                outside = r["peak_bytes"] - r["arena_bytes"]
                ops = ", ".join(f"{n} {b / mib:.1f}M" for n, b in r.get("outside_ops", []))
                print(f"{side}: allocated {r['peak_bytes'] / mib:.1f}M = arena x {r['peak_bytes'] / r['arena_bytes']:.4f}; "
                      f"outside the arena {outside / mib:.1f}M" + (f" (most: {ops})" if ops else "")
                      + (f" (by op: {r['outside_ops_error']})" if "outside_ops_error" in r else ""))
    sim = rows.get("memplan", {}).get("simulated_eager")
    if sim is not None:
        real = rows["fsdp2-eager"]["peak_bytes"]
        key = "pytorch-allocated" if args.device == "cuda" else "program-order"
        print(f"fsdp2-eager simulated on memplan's captured graph (FSDP2's order rebuilt, memplan.baselines): "
              f"{sim[key] / mib:.1f}M ({key}), {100 * (sim[key] / real - 1):+.1f}% against the real fsdp2-eager")
    if "added_flops_share" in rows["memplan-fit-0.1%"]:
        print(f"memplan-fit-0.1% adds {100 * rows['memplan-fit-0.1%']['added_flops_share']:.3f}% FLOPs")


if __name__ == "__main__":
    sys.exit(main())
