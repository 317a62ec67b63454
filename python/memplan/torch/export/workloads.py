"""Training steps to export: a model, a batch and a loss, built from configs.

A :class:`Workload` is built inside a device context (``meta`` for tracing
without a GPU, fake ``cuda`` tensors for tracing on a GPU machine, real
``cuda`` for measuring), so building one never downloads weights and costs no
memory on ``meta``. Every named workload is listed in :data:`WORKLOADS`; any
other module is reached with ``--model package.module:function``, where the
function takes ``(batch, seq, dtype)`` and returns a :class:`Workload`.

Defaults (documented in ``docs/torch-export.md``):

====================  ==============================  ======  ======
name                  model                           batch   seq
====================  ==============================  ======  ======
``resnet50``          torchvision ResNet-50, 224x224  32      -
``vit_b_16``          torchvision ViT-B/16, 224x224   32      -
``bert-base``         HF BertForMaskedLM(BertConfig)  8       512
``gpt2``              HF GPT2LMHeadModel(GPT2Config)  8       1024
``gpt2-xl``           GPT-2 XL sizes (48x1600, 25 h)  1       1024
``mlp``               Linear-BatchNorm-ReLU-Linear     8       -
``tiny-attn``         one attention + MLP block       2       16
====================  ==============================  ======  ======
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Workload:
    """One training step's ingredients.

    ``batch`` holds the step's input tensors by name (they become step
    inputs); ``loss(model, batch)`` runs the forward pass and returns the
    scalar loss.
    """

    name: str
    model: nn.Module
    batch: Dict[str, torch.Tensor]
    loss: Callable[[nn.Module, Dict[str, torch.Tensor]], torch.Tensor]
    config: Dict[str, Any] = field(default_factory=dict)


def _image_classifier(name: str, ctor, batch: int, dtype: torch.dtype) -> Workload:
    model = ctor(weights=None).to(dtype)
    images = torch.randn(batch, 3, 224, 224, dtype=dtype)
    labels = torch.randint(0, 1000, (batch,))

    def loss(m, b):
        return F.cross_entropy(m(b["images"]), b["labels"])

    return Workload(name, model, {"images": images, "labels": labels}, loss,
                    {"batch": batch, "image_size": 224, "classes": 1000})


def resnet50(batch: int = 32, seq: Optional[int] = None, dtype=torch.float32) -> Workload:
    import torchvision

    return _image_classifier("resnet50", torchvision.models.resnet50, batch, dtype)


def vit_b_16(batch: int = 32, seq: Optional[int] = None, dtype=torch.float32) -> Workload:
    import torchvision

    return _image_classifier("vit_b_16", torchvision.models.vit_b_16, batch, dtype)


def _lm(name: str, model: nn.Module, vocab: int, batch: int, seq: int, **kw) -> Workload:
    """A language model trained on its own input ids (the model shifts them
    for causal LMs); ``kw`` goes to the model call."""
    ids = torch.randint(0, vocab, (batch, seq))

    def loss(m, b):
        return m(input_ids=b["input_ids"], labels=b["input_ids"], **kw).loss

    return Workload(name, model, {"input_ids": ids}, loss, {"batch": batch, "seq": seq})


def bert_base(batch: int = 8, seq: Optional[int] = None, dtype=torch.float32) -> Workload:
    from transformers import BertConfig, BertForMaskedLM

    seq = seq or 512
    cfg = BertConfig(attn_implementation="sdpa")
    model = BertForMaskedLM(cfg).to(dtype)
    w = _lm("bert-base", model, cfg.vocab_size, batch, seq)
    w.config.update(layers=cfg.num_hidden_layers, width=cfg.hidden_size, attention="sdpa")
    return w


def _gpt2(name: str, cfg, batch: int, seq: Optional[int], dtype) -> Workload:
    from transformers import GPT2LMHeadModel

    seq = seq or cfg.n_positions
    model = GPT2LMHeadModel(cfg).to(dtype)
    # A training step keeps no key/value cache (with one, every layer would
    # also copy its keys and values into the cache).
    w = _lm(name, model, cfg.vocab_size, batch, seq, use_cache=False)
    w.config.update(use_cache=False, layers=cfg.n_layer, width=cfg.n_embd, heads=cfg.n_head, attention="sdpa")
    return w


def gpt2(batch: int = 8, seq: Optional[int] = None, dtype=torch.float32) -> Workload:
    from transformers import GPT2Config

    return _gpt2("gpt2", GPT2Config(attn_implementation="sdpa"), batch, seq, dtype)


def gpt2_xl(batch: int = 1, seq: Optional[int] = None, dtype=torch.float32) -> Workload:
    from transformers import GPT2Config

    cfg = GPT2Config(n_embd=1600, n_layer=48, n_head=25, attn_implementation="sdpa")
    return _gpt2("gpt2-xl", cfg, batch, seq, dtype)


def mlp(batch: int = 8, seq: Optional[int] = None, dtype=torch.float32) -> Workload:
    """A tiny MLP with a BatchNorm (so buffers are updated in place)."""
    model = nn.Sequential(
        nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10)
    ).to(dtype)
    x = torch.randn(batch, 32, dtype=dtype)
    y = torch.randint(0, 10, (batch,))

    def loss(m, b):
        return F.cross_entropy(m(b["x"]), b["y"])

    return Workload("mlp", model, {"x": x, "y": y}, loss, {"batch": batch})


class _TinyBlock(nn.Module):
    def __init__(self, width: int = 64, heads: int = 4, vocab: int = 100) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, width)
        self.ln = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return self.out(F.gelu(self.fc(x)))


def tiny_attn(batch: int = 2, seq: Optional[int] = None, dtype=torch.float32) -> Workload:
    """One causal attention block with tied-free LM head (tests SDPA)."""
    seq = seq or 16
    model = _TinyBlock().to(dtype)
    ids = torch.randint(0, 100, (batch, seq))

    def loss(m, b):
        logits = m(b["ids"])
        return F.cross_entropy(logits.flatten(0, 1), b["ids"].flatten())

    return Workload("tiny-attn", model, {"ids": ids}, loss, {"batch": batch, "seq": seq})


WORKLOADS: Dict[str, Callable[..., Workload]] = {
    "resnet50": resnet50,
    "vit_b_16": vit_b_16,
    "bert-base": bert_base,
    "gpt2": gpt2,
    "gpt2-xl": gpt2_xl,
    "mlp": mlp,
    "tiny-attn": tiny_attn,
}


def resolve(name: str) -> Callable[..., Workload]:
    """A named workload, or ``package.module:function``."""
    if name in WORKLOADS:
        return WORKLOADS[name]
    if ":" in name:
        mod, _, fn = name.partition(":")
        try:
            f = getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--model {name!r}: cannot load {fn!r} from {mod!r}: {e}") from None
        return f
    raise ValueError(
        f"unknown model {name!r}: choose one of {', '.join(WORKLOADS)} or give package.module:function"
    )
