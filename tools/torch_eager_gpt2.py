#!/usr/bin/env python3
"""PyTorch eager baseline for `memplan run`: the same GPT-2 training step
(configuration, batch shape, tied LM head, pre-LayerNorm blocks, tanh GELU,
explicit causal attention, cross-entropy, AdamW) run in PyTorch eager mode.

Prints per step the loss and time, and torch.cuda.max_memory_allocated() /
max_memory_reserved() over the whole run (the first step creates the Adam
state, as memplan's plan holds it from the start). With --memplan FILE (the
output of `memplan run ... --json`) it prints a side-by-side table.

    python3 tools/torch_eager_gpt2.py --config gpt2-small --steps 10
    memplan run --example gpt2-small --device cuda --steps 10 --json > memplan.json
    python3 tools/torch_eager_gpt2.py --config gpt2-small --steps 10 --memplan memplan.json

The model follows src/models/gpt2.rs op for op: attention materializes the
scores and probabilities (no fused kernel; --sdpa uses PyTorch's fused
scaled_dot_product_attention instead, the counterpart of
`memplan run --fused-attention`). TF32 is off in
both (memplan's cuBLAS calls are full f32). Token ids are random: values do
not change memory or time.
"""

import argparse
import json
import math
import statistics
import sys
import time

PRESETS = {
    # layers, width, heads, seq, batch (src/models/gpt2.rs Gpt2Config::preset)
    "gpt2-tiny": (2, 128, 4, 128, 2),
    "gpt2-small": (12, 768, 12, 1024, 1),
    "gpt2-medium": (24, 1024, 16, 1024, 1),
    "gpt2-large": (36, 1280, 20, 1024, 1),
    "gpt2-xl": (48, 1600, 25, 1024, 1),
}


def step_args(p):
    """The options every eager baseline shares: steps, device, optimizer,
    checkpointing, clipping, seed, output."""
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (time only)")
    p.add_argument("--optimizer", default="adamw", choices=["adam", "adamw"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--foreach", action="store_true",
                   help="multi-tensor Adam (PyTorch's CUDA default); off = single-tensor, as memplan's graph models")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block")
    p.add_argument("--clip-grad-norm", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--memplan", metavar="FILE", action="append", default=[],
                   help="`memplan run --json` output to compare with (repeat for several)")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="gpt2-tiny", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--sdpa", action="store_true", help="fused attention instead of the explicit one")
    step_args(p)
    a = p.parse_args(argv)
    layers, width, heads, seq, batch = PRESETS[a.config]
    a.layers = a.layers or layers
    a.width = a.width or width
    a.heads = a.heads or heads
    a.seq = a.seq or seq
    a.batch = a.batch or batch
    if a.width % a.heads:
        p.error(f"width {a.width} is not a multiple of heads {a.heads}")
    return a


def build(a, torch):
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            c = a.width
            self.ln_1 = nn.LayerNorm(c, eps=1e-5)
            self.c_attn = nn.Linear(c, 3 * c)
            self.c_proj = nn.Linear(c, c)
            self.ln_2 = nn.LayerNorm(c, eps=1e-5)
            self.c_fc = nn.Linear(c, 4 * c)
            self.mlp_proj = nn.Linear(4 * c, c)
            std = 0.02 / math.sqrt(2 * a.layers)
            for lin in (self.c_attn, self.c_fc):
                nn.init.normal_(lin.weight, std=0.02)
                nn.init.zeros_(lin.bias)
            for lin in (self.c_proj, self.mlp_proj):
                nn.init.normal_(lin.weight, std=std)
                nn.init.zeros_(lin.bias)

        def attention(self, x):
            b, t, c = x.shape
            h, d = a.heads, c // a.heads
            q, k, v = self.c_attn(x).split(c, dim=2)
            q = q.view(b, t, h, d).transpose(1, 2)
            k = k.view(b, t, h, d).transpose(1, 2)
            v = v.view(b, t, h, d).transpose(1, 2)
            if a.sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
                mask = torch.ones(t, t, device=x.device, dtype=torch.bool).triu(1)
                probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
                y = probs @ v
            return self.c_proj(y.transpose(1, 2).reshape(b, t, c))

        def forward(self, x):
            x = x + self.attention(self.ln_1(x))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT2(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(a.vocab, a.width)
            self.wpe = nn.Embedding(a.seq, a.width)
            nn.init.normal_(self.wte.weight, std=0.02)
            nn.init.normal_(self.wpe.weight, std=0.01)
            self.h = nn.ModuleList(Block() for _ in range(a.layers))
            self.ln_f = nn.LayerNorm(a.width, eps=1e-5)

        def forward(self, tokens, targets):
            t = tokens.shape[1]
            x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
            for blk in self.h:
                if a.checkpoint:
                    x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
                else:
                    x = blk(x)
            logits = self.ln_f(x) @ self.wte.weight.t()  # tied LM head
            return F.cross_entropy(logits.view(-1, a.vocab), targets.view(-1))

    return GPT2()


def main(argv=None):
    a = parse_args(argv)
    torch = import_torch("torch_eager_gpt2.py", a.device)
    torch.manual_seed(a.seed)
    model = build(a, torch)
    out = measure(a, torch, model, {"attention": "sdpa" if a.sdpa else "explicit"})
    report(a, out)


def import_torch(script, device):
    """torch, with TF32 off (memplan's cuBLAS calls are full f32), or exit
    with why not."""
    try:
        import torch
    except ImportError:
        sys.exit(f"{script}: PyTorch is not installed (pip install torch)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"{script}: no CUDA device visible to PyTorch (use --device cpu for a smoke run)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


def measure(a, torch, model, extra, autocast=None):
    """Runs `a.steps` eager steps of `model(tokens, targets)` (AdamW or Adam,
    optional clipping, under `autocast` if given) and returns the record:
    per-step loss and time, the median step time without the first step,
    and on CUDA max_memory_allocated / max_memory_reserved."""
    import contextlib

    cuda = a.device.startswith("cuda")
    dev = torch.device(a.device)
    model = model.to(dev)
    params = sum(p.numel() for p in model.parameters())
    opt_cls = torch.optim.AdamW if a.optimizer == "adamw" else torch.optim.Adam
    wd = a.weight_decay if a.optimizer == "adamw" else 0.0
    opt = opt_cls(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, foreach=a.foreach)
    g = torch.Generator(device="cpu").manual_seed(a.seed + 1)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(dev)
    targets = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(dev)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    steps = []
    for _ in range(a.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast() if autocast else contextlib.nullcontext():
            loss = model(tokens, targets)
        loss.backward()
        if a.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad_norm)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        steps.append({"loss": loss.item(), "seconds": time.perf_counter() - t0})
    times = [s["seconds"] for s in steps]
    steady = times[1:] if len(times) > 1 else times
    return {
        "config": a.config,
        "layers": a.layers, "width": a.width, "heads": a.heads, "seq": a.seq, "batch": a.batch, "vocab": a.vocab,
        "parameters": params,
        "device": str(dev),
        "torch": torch.__version__,
        **extra,
        "foreach": a.foreach,
        "steps": steps,
        "median_step_seconds": statistics.median(steady),
        "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "max_memory_reserved": torch.cuda.max_memory_reserved() if cuda else None,
    }


def report(a, out):
    """Prints the record (as JSON with --json), and the side-by-side table
    with --memplan."""
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"PyTorch {out['torch']} eager, {a.config} ({out['parameters']:,} parameters) on {out['device']}")
        for i, s in enumerate(out["steps"]):
            print(f"step {i + 1}: loss {s['loss']:.4f}, {s['seconds']:.4f} s")
        print(f"median step time {out['median_step_seconds']:.4f} s")
        if out["max_memory_allocated"] is not None:
            print(f"max_memory_allocated {out['max_memory_allocated']:,} bytes")
            print(f"max_memory_reserved  {out['max_memory_reserved']:,} bytes")
    for path in a.memplan:
        with open(path) as f:
            m = json.load(f)
        if len(a.memplan) > 1:
            print(f"\n== {path} (attention: {m.get('attention', 'flash')})")
        compare(out, m)


def compare(t, m):
    mib = lambda b: "-" if b is None else f"{b / 2**20:,.1f} MiB"
    measured = max(s["measured_peak_bytes"] for s in m["steps"])
    rows = [
        ("PyTorch eager max_memory_allocated", mib(t["max_memory_allocated"]), ""),
        ("PyTorch eager max_memory_reserved", mib(t["max_memory_reserved"]), f"{t['median_step_seconds']:.4f} s"),
        ("memplan planned peak (arena)", mib(m["arena_bytes"]), ""),
        ("memplan workspace", mib(m["workspace_bytes"]), ""),
        ("memplan measured peak", mib(measured), f"{m['median_step_seconds']:.4f} s"),
    ]
    print()
    print(f"{'':40} {'memory':>14} {'step time':>10}")
    for name, mem, tm in rows:
        print(f"{name:40} {mem:>14} {tm:>10}")
    res = t["max_memory_reserved"]
    if res:
        print(f"planned peak vs PyTorch reserved: {100 * (1 - m['arena_bytes'] / res):.1f}% less")
        print(f"measured vs planned x 1.01 + workspace: {measured:,} <= "
              f"{int(m['arena_bytes'] * 1.01) + m['workspace_bytes']:,}: "
              f"{measured <= m['arena_bytes'] * 1.01 + m['workspace_bytes']}")
        print(f"step time ratio memplan / PyTorch: {m['median_step_seconds'] / t['median_step_seconds']:.2f}")


if __name__ == "__main__":
    main()
