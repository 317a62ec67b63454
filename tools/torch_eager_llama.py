#!/usr/bin/env python3
"""PyTorch eager baseline for `memplan run` on the built-in Llama steps: the
same training step (src/models/llama.rs: token embedding, pre-norm blocks
with RMSNorm, grouped-query causal attention with rotary embeddings through
PyTorch's fused scaled_dot_product_attention, SwiGLU MLP, untied LM head
unless the preset ties it, cross-entropy, AdamW) in PyTorch eager mode.

Prints per step the loss and time, and on CUDA max_memory_allocated /
max_memory_reserved over the whole run; with --memplan FILE (the output of
`memplan run ... --json`) a side-by-side table, as tools/torch_eager_gpt2.py.

    python3 tools/torch_eager_llama.py --config llama3-1b --seq 1024 --mixed-precision --steps 10
    memplan run --example llama3-1b --seq 1024 --mixed-precision --device cuda --steps 10 --json > m.json
    python3 tools/torch_eager_llama.py --config llama3-1b --seq 1024 --mixed-precision --memplan m.json

--mixed-precision is the counterpart of `memplan run --mixed-precision`: f32
parameters and Adam moments, compute and activations in bf16 (autocast),
gradients reaching the update in f32. Weights are packed as memplan's are
(one query/key/value projection, one gate/up projection), no biases. RoPE
writes one rotated `qkv` (the graph's `rope` output); the projection's own
output dies there, as in the graph.

--graph-kernels runs RMSNorm and SwiGLU as the built-in graph's fused ops
(autograd functions that save what `rmsnorm` and `swiglu` save: the input
and the per-row rstd; the gate/up input), where PyTorch's own ops on the CPU
also save the normalized input (before the weight) and silu(gate).

--allocator-peak (CPU) measures the peak bytes of one step from the
allocator's events (as memplan.torch's `allocator_peak`: the tensors held
before the step, parameters, optimizer state, batch and buffers, plus the
highest running sum of allocations and frees during the second step), the
figure `memplan compare`'s `pytorch-allocated` simulates. --world-size W
(CPU, with --allocator-peak) runs the step under FSDP2 (`fully_shard` on the
token embedding, every block, the final norm and the LM head, as
src/models/fsdp.rs cuts units, then on the root) on W gloo ranks spawned on
this machine, each with its own batch, and reports each rank's peak:

    python3 tools/torch_eager_llama.py --device cpu --layers 4 --seq 256 --batch 2 --allocator-peak --world-size 2
    memplan compare --example llama-tiny --layers 4 --seq 256 --batch 2 --world-size 2
"""

import argparse
import datetime
import json
import math
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_eager_gpt2 as common  # noqa: E402

PRESETS = {
    # layers, width, heads, kv_heads, ffn, vocab, seq, batch, tied, rope theta
    # (src/models/llama.rs LlamaConfig::preset)
    "llama-tiny": (2, 128, 4, 2, 256, 512, 64, 2, False, 10_000.0),
    "llama3-1b": (16, 2048, 32, 8, 8192, 128_256, 4096, 1, True, 500_000.0),
    "llama3-8b": (32, 4096, 32, 8, 14_336, 128_256, 4096, 1, False, 500_000.0),
    "llama2-7b": (32, 4096, 32, 32, 11_008, 32_000, 4096, 1, False, 10_000.0),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama-tiny", choices=sorted(PRESETS))
    for name in ("layers", "seq", "batch"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--mixed-precision", action="store_true", help="bf16 autocast over f32 parameters")
    p.add_argument("--graph-kernels", action="store_true",
                   help="RMSNorm and SwiGLU as the built-in graph's fused ops (what they save for the backward)")
    p.add_argument("--allocator-peak", action="store_true",
                   help="CPU: the step's peak bytes from the allocator's events (the second step)")
    p.add_argument("--world-size", type=int, default=1,
                   help="with --allocator-peak: FSDP2 over this many gloo ranks (processes) on this machine")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the ranks are stopped")
    common.step_args(p)
    a = p.parse_args(argv)
    if a.world_size > 1 and not (a.allocator_peak and a.device == "cpu"):
        p.error("--world-size needs --allocator-peak and --device cpu")
    layers, a.width, a.heads, a.kv_heads, a.ffn, a.vocab, seq, batch, a.tied, a.theta = PRESETS[a.config]
    a.layers = a.layers or layers
    a.seq = a.seq or seq
    a.batch = a.batch or batch
    return a


def graph_kernels(torch):
    """The rotation and the fused kernels of memplan's built-in Llama graph
    (`rope`, `rmsnorm`, `swiglu`), as autograd functions saving what the
    graph's kernels save."""
    F = torch.nn.functional

    def rope(x, cos, sin):
        # Rotate pairs (x[2i], x[2i+1]) by position * theta^(-2i/D).
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    class FusedRMSNorm(torch.autograd.Function):
        """The graph's `rmsnorm`: saves the input and the per-row rstd."""

        @staticmethod
        def forward(ctx, x, w):
            rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
            ctx.save_for_backward(x, rstd, w)
            return x * rstd * w

        @staticmethod
        def backward(ctx, dy):
            # One [rows, C] temporary beside dx at a time, as a fused kernel.
            x, rstd, w = ctx.saved_tensors
            xhat = x * rstd
            dw = (dy * xhat).reshape(-1, x.shape[-1]).sum(0)
            dx = dy * w
            dot = (dx.unsqueeze(-2) @ xhat.unsqueeze(-1)).squeeze(-1) / x.shape[-1]
            return dx.sub_(xhat.mul_(dot)).mul_(rstd), dw

    class FusedSwiGLU(torch.autograd.Function):
        """The graph's `swiglu`: saves the gate/up input only."""

        @staticmethod
        def forward(ctx, gu):
            ctx.save_for_backward(gu)
            gate, up = gu.chunk(2, dim=-1)
            return F.silu(gate) * up

        @staticmethod
        def backward(ctx, dh):
            # Written into the gradient's halves: no temporaries, as a fused kernel.
            (gu,) = ctx.saved_tensors
            gate, up = gu.chunk(2, dim=-1)
            dgu = torch.empty_like(gu)
            dgate, dup = dgu.chunk(2, dim=-1)
            torch.sigmoid(gate, out=dgate)  # s
            torch.mul(gate, dgate, out=dup)  # silu(gate)
            dgate.addcmul_(dup, dgate, value=-1).add_(dup).mul_(dh).mul_(up)  # s·(1 + gate·(1 − s))·dh·up
            dup.mul_(dh)
            return dgu

    return rope, FusedRMSNorm, FusedSwiGLU


def build(a, torch):
    nn = torch.nn
    F = torch.nn.functional
    d = a.width // a.heads
    group = a.heads // a.kv_heads
    rope, FusedRMSNorm, FusedSwiGLU = graph_kernels(torch)

    class Norm(nn.RMSNorm):
        def forward(self, x):
            if a.graph_kernels:
                return FusedRMSNorm.apply(x, self.weight)
            return super().forward(x)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            c = a.width
            self.attn_norm = Norm(c, eps=1e-5)
            self.wqkv = nn.Linear(c, (a.heads + 2 * a.kv_heads) * d, bias=False)
            self.wo = nn.Linear(c, c, bias=False)
            self.mlp_norm = Norm(c, eps=1e-5)
            self.w13 = nn.Linear(c, 2 * a.ffn, bias=False)
            self.w2 = nn.Linear(a.ffn, c, bias=False)
            for lin in (self.wqkv, self.w13):
                nn.init.normal_(lin.weight, std=0.02)
            for lin in (self.wo, self.w2):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * a.layers))

        def forward(self, x, cos, sin):
            b, t, c = x.shape
            qkv = self.wqkv(self.attn_norm(x))
            q, k, v = qkv.split([a.heads * d, a.kv_heads * d, a.kv_heads * d], dim=-1)
            # One rotated qkv, as the graph's `rope` output: the attention
            # saves views of it, and the projection's output dies here (a
            # view of it as v would keep all of it alive next to q and k).
            qk = rope(torch.cat((q, k), dim=-1).view(b, t, a.heads + a.kv_heads, d), cos, sin)
            qkv = torch.cat((qk.flatten(-2), v), dim=-1).view(b, t, a.heads + 2 * a.kv_heads, d)
            q, k, v = qkv.split([a.heads, a.kv_heads, a.kv_heads], dim=2)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=group > 1)
            x = x + self.wo(y.transpose(1, 2).reshape(b, t, c))
            gu = self.w13(self.mlp_norm(x))
            if a.graph_kernels:
                return x + self.w2(FusedSwiGLU.apply(gu))
            gate, up = gu.chunk(2, dim=-1)
            return x + self.w2(F.silu(gate) * up)

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(a.vocab, a.width)
            nn.init.normal_(self.tok.weight, std=0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(a.layers))
            self.norm = Norm(a.width, eps=1e-5)
            self.head = None if a.tied else nn.Linear(a.width, a.vocab, bias=False)
            if self.head is not None:
                nn.init.normal_(self.head.weight, std=0.02)
            inv = a.theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
            angles = torch.outer(torch.arange(a.seq, dtype=torch.float32), inv)
            self.register_buffer("cos", angles.cos()[:, None, :], persistent=False)
            self.register_buffer("sin", angles.sin()[:, None, :], persistent=False)

        def forward(self, tokens, targets):
            x = self.tok(tokens)
            t = tokens.shape[1]
            cos, sin = self.cos[:t], self.sin[:t]
            for blk in self.blocks:
                if a.checkpoint:
                    x = torch.utils.checkpoint.checkpoint(blk, x, cos, sin, use_reentrant=False)
                else:
                    x = blk(x, cos, sin)
            x = self.norm(x)
            logits = x @ self.tok.weight.t() if self.head is None else self.head(x)
            return F.cross_entropy(logits.view(-1, a.vocab).float(), targets.view(-1))

    return Llama()


def main(argv=None):
    a = parse_args(argv)
    torch = common.import_torch("torch_eager_llama.py", a.device)
    if a.allocator_peak:
        return report_peaks(a, peaks(a))
    torch.manual_seed(a.seed)
    model = build(a, torch)
    kind = "cuda" if a.device.startswith("cuda") else "cpu"
    autocast = (lambda: torch.autocast(kind, dtype=torch.bfloat16)) if a.mixed_precision else None  # noqa: E731

    extra = {"kv_heads": a.kv_heads, "ffn": a.ffn, "mixed_precision": a.mixed_precision,
             "attention": "sdpa", "graph_kernels": a.graph_kernels}
    common.report(a, common.measure(a, torch, model, extra, autocast))


def allocator_peak(torch, fn, resident):
    """Peak bytes on the CPU while `fn()` runs: the storages of `resident`
    plus the highest running sum of the allocator's events during the call
    (memplan.torch._run.allocator_peak)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    storages = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in resident}
    return sum(storages.values()) + peak


def rank_peak(a, rank=0):
    """This rank's step (FSDP2 when a.world_size > 1, in an initialised
    process group) and its allocator peak, measured on the second step."""
    import contextlib

    import torch

    torch.manual_seed(a.seed)
    model = build(a, torch)
    if a.world_size > 1:
        from torch.distributed.fsdp import fully_shard

        # The units of src/models/fsdp.rs: the embedding, each block, the
        # final norm, the head; then the root (no parameters of its own).
        for unit in [model.tok, *model.blocks, model.norm, model.head]:
            if unit is not None:
                fully_shard(unit)
        fully_shard(model)
    opt_cls = torch.optim.AdamW if a.optimizer == "adamw" else torch.optim.Adam
    wd = a.weight_decay if a.optimizer == "adamw" else 0.0
    opt = opt_cls(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, foreach=a.foreach)
    g = torch.Generator(device="cpu").manual_seed(a.seed + 1 + rank)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
    targets = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16) if a.mixed_precision else contextlib.nullcontext():
            loss = model(tokens, targets)
        loss.backward()
        if a.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad_norm)
        opt.step()
        return loss.item()

    step()

    def local(x):
        return x.to_local() if hasattr(x, "to_local") else x

    resident = [local(x) for x in [*model.parameters(), *model.buffers(), tokens, targets,
                                   *(v for st in opt.state.values() for v in st.values())]]
    resident = [x for x in resident if isinstance(x, torch.Tensor)]
    peak = allocator_peak(torch, step, resident)
    return {"rank": rank, "peak_bytes": peak,
            "resident_bytes": sum(x.untyped_storage().nbytes() for x in resident)}


def _rank_main(rank, a, port, path):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=a.world_size,
                            timeout=datetime.timedelta(seconds=a.timeout))
    try:
        out = rank_peak(a, rank)
        with open(f"{path}.{rank}", "w") as f:
            json.dump(out, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def peaks(a):
    """Per-rank allocator peaks of the step: one rank in this process, or
    `a.world_size` gloo ranks spawned on a free port (each stopped after
    `a.timeout` seconds)."""
    if a.world_size <= 1:
        return [rank_peak(a)]
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank")
        ctx = mp.start_processes(_rank_main, args=(a, port, path), nprocs=a.world_size, join=False,
                                 start_method="spawn")
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=a.timeout)
        while not ctx.join(timeout=1.0):
            if datetime.datetime.now() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"torch_eager_llama.py: ranks still running after {a.timeout:.0f} s")
        out = []
        for r in range(a.world_size):
            with open(f"{path}.{r}") as f:
                out.append(json.load(f))
    return out


def report_peaks(a, rows):
    out = {"config": a.config, "layers": a.layers, "seq": a.seq, "batch": a.batch,
           "world_size": a.world_size, "graph_kernels": a.graph_kernels,
           "mixed_precision": a.mixed_precision, "checkpoint": a.checkpoint, "ranks": rows}
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for r in rows:
            print(f"rank {r['rank']}: peak {r['peak_bytes']:,} bytes "
                  f"({r['resident_bytes']:,} held before and after the step)")
    return out


if __name__ == "__main__":
    main()
