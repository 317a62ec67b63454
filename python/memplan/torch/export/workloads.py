"""The one catalogue of models the benchmarks, the export and the tools
train: named Hugging Face shapes (:data:`GPT2_SHAPES`, :data:`LLAMA_SHAPES`,
built by :func:`hf_gpt2` and :func:`hf_llama`), the losses they are
trained with, and the named workloads of ``python -m memplan.torch.export``
(:data:`WORKLOADS`, each a :class:`Workload`: model, batch, loss, built from
configs).

A :class:`Workload` is built inside a device context (``meta`` for tracing
without a GPU, real ``cuda`` for measuring), so building one never
downloads weights and costs no memory on ``meta``. Any other module is
reached with ``--model package.module:function``, where the function takes
``(batch, seq, dtype)`` and returns a :class:`Workload`.

The export's workloads (documented in ``docs/torch-export.md``):

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

The benchmarks' models are the shapes below, by name; where two benchmarks
need different sizes they use different names, so each shape is written
once.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


# Hugging Face GPT-2 shapes (GPT2Config fields), by name.
GPT2_SHAPES: Dict[str, Dict[str, Any]] = {
    # bench --tiny: each op a few microseconds, the replay's overhead per op
    "tiny-32": dict(n_layer=4, n_embd=32, n_head=2, vocab_size=128, n_positions=16),
    # the baselines' tests and tools/simulated_baselines.py's gpt2-tiny
    "tiny-64": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64),
    # benchmarks.bench's CPU models
    "4l-256": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=4096, n_positions=256),
    # benchmarks.bench_baselines' small size
    "4l-256-v8192": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=256),
    # benchmarks.bench_baselines' medium size: about 150M parameters
    "8l-1024": dict(n_layer=8, n_embd=1024, n_head=16, vocab_size=32000, n_positions=2048),
    # GPT-2 small (GPT2Config's defaults)
    "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
    # GPT-2 XL: 1.56B parameters
    "xl": dict(n_layer=48, n_embd=1600, n_head=25, vocab_size=50257, n_positions=1024),
}

# Hugging Face Llama shapes (LlamaConfig fields), by name.
LLAMA_SHAPES: Dict[str, Dict[str, Any]] = {
    "tiny-32": dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=1, vocab_size=128, max_position_embeddings=16),
    "tiny-64": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=512, max_position_embeddings=64),
    "4l-256": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=4096, max_position_embeddings=256),
    "4l-256-v8192": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=8192, max_position_embeddings=256),
    "8l-1024": dict(num_hidden_layers=8, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                    num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),
    # Llama 3.2 1B's shape: 1.24B parameters, tied embeddings
    "1b": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=2048, tie_word_embeddings=True),
}


def gpt2_config(shape: str, dropout: float = 0.0, **override):
    """GPT2Config of a named shape, every dropout (residual, embedding,
    attention) at `dropout`; `override` changes any other field."""
    from transformers import GPT2Config

    return GPT2Config(**{**GPT2_SHAPES[shape], "resid_pdrop": dropout, "embd_pdrop": dropout,
                         "attn_pdrop": dropout, **override})


def llama_config(shape: str, dropout: float = 0.0, **override):
    """LlamaConfig of a named shape, attention dropout at `dropout`."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**LLAMA_SHAPES[shape], "attention_dropout": dropout, **override})


def hf_gpt2(shape: str, dropout: float = 0.0, **override) -> nn.Module:
    """GPT2LMHeadModel of a named shape (random weights, on the current
    default device)."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(gpt2_config(shape, dropout, **override))


def hf_llama(shape: str, dropout: float = 0.0, **override) -> nn.Module:
    """LlamaForCausalLM of a named shape."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(shape, dropout, **override))


def lm_loss(m, b):
    """A causal LM trained on its own ids (`b`, a tensor; the model shifts
    them)."""
    return m(input_ids=b, labels=b).loss


def lm_loss_bf16(m, b):
    """:func:`lm_loss` under bf16 autocast on the batch's device (f32
    parameters: mixed precision as Hugging Face's Trainer runs
    ``bf16=True``)."""
    with torch.autocast(b.device.type, dtype=torch.bfloat16):
        return m(input_ids=b, labels=b).loss


def classify_loss(m, b):
    """Cross-entropy of a classifier on ``(inputs, labels)``."""
    return F.cross_entropy(m(b[0]), b[1])


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
    """GPT-2 small as GPT2Config() makes it (dropout 0.1)."""
    return _gpt2("gpt2", gpt2_config("small", 0.1, attn_implementation="sdpa"), batch, seq, dtype)


def gpt2_xl(batch: int = 1, seq: Optional[int] = None, dtype=torch.float32) -> Workload:
    """GPT-2 XL's sizes, GPT2Config's other defaults (dropout 0.1)."""
    return _gpt2("gpt2-xl", gpt2_config("xl", 0.1, attn_implementation="sdpa"), batch, seq, dtype)


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
