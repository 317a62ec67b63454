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
(one query/key/value projection, one gate/up projection), no biases.
"""

import argparse
import math
import os
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
    common.step_args(p)
    a = p.parse_args(argv)
    layers, a.width, a.heads, a.kv_heads, a.ffn, a.vocab, seq, batch, a.tied, a.theta = PRESETS[a.config]
    a.layers = a.layers or layers
    a.seq = a.seq or seq
    a.batch = a.batch or batch
    return a


def build(a, torch):
    nn = torch.nn
    F = torch.nn.functional
    d = a.width // a.heads
    group = a.heads // a.kv_heads

    def rope(x, cos, sin):
        # Rotate pairs (x[2i], x[2i+1]) by position * theta^(-2i/D).
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            c = a.width
            self.attn_norm = nn.RMSNorm(c, eps=1e-5)
            self.wqkv = nn.Linear(c, (a.heads + 2 * a.kv_heads) * d, bias=False)
            self.wo = nn.Linear(c, c, bias=False)
            self.mlp_norm = nn.RMSNorm(c, eps=1e-5)
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
            q = rope(q.view(b, t, a.heads, d), cos, sin).transpose(1, 2)
            k = rope(k.view(b, t, a.kv_heads, d), cos, sin).transpose(1, 2)
            v = v.view(b, t, a.kv_heads, d).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=group > 1)
            x = x + self.wo(y.transpose(1, 2).reshape(b, t, c))
            gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
            return x + self.w2(F.silu(gate) * up)

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(a.vocab, a.width)
            nn.init.normal_(self.tok.weight, std=0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(a.layers))
            self.norm = nn.RMSNorm(a.width, eps=1e-5)
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
    torch.manual_seed(a.seed)
    model = build(a, torch)
    autocast = None
    if a.mixed_precision:
        kind = "cuda" if a.device.startswith("cuda") else "cpu"

        def autocast():
            return torch.autocast(kind, dtype=torch.bfloat16)

    extra = {"kv_heads": a.kv_heads, "ffn": a.ffn, "mixed_precision": a.mixed_precision,
             "attention": "sdpa"}
    common.report(a, common.measure(a, torch, model, extra, autocast))


if __name__ == "__main__":
    main()
