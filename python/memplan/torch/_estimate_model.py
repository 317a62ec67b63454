"""The model an estimate captures, made as its framework makes it, on the
meta device: a Hugging Face causal LM from its config, torchtitan's Llama 3
from its registry's flavor, or the caller's own model class; checkpointed
and sharded with FSDP2 as that framework does (:mod:`memplan.torch._estimate`).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from memplan import MemplanError

AC_MODES = ("none", "selective", "selective-op", "full")


class Source:
    """Where the model comes from: ``kind`` is ``"hf"``, ``"torchtitan"``
    or ``"class"``; ``heads`` and ``kv_heads`` its attention heads (None
    where unknown), ``experts`` its routed experts (0: dense), ``name`` a
    line for the table."""

    def __init__(self, kind: str, name: str, make: Callable[[int], torch.nn.Module], heads: Optional[int],
                 kv_heads: Optional[int], experts: int = 0, vocab: Optional[int] = None) -> None:
        self.kind, self.name, self.make = kind, name, make
        self.heads, self.kv_heads, self.experts, self.vocab = heads, kv_heads, experts, vocab


def _hf_config(config: Any):
    """A ``transformers`` config from a path (a ``config.json`` or the
    folder holding it), a dict or a config object."""
    transformers = _require("transformers", "a Hugging Face config")
    if isinstance(config, transformers.PretrainedConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                config = json.load(f)
        except OSError as e:
            raise MemplanError(f"config {path}: cannot read it ({e.strerror})", "io") from e
        except json.JSONDecodeError as e:
            raise MemplanError(f"config {path}: not JSON ({e})", "input") from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise MemplanError("config: a Hugging Face config has a 'model_type' (a config.json as `transformers` "
                           "saves it)", "input")
    d = dict(config)
    try:
        return transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    except (ValueError, KeyError) as e:
        raise MemplanError(f"config: transformers cannot make a config of it ({e})", "input") from e


def hf_source(config: Any, layers: Optional[int] = None) -> Source:
    """The config's causal LM (with `layers` decoder blocks if given)."""
    cfg = _hf_config(config)
    if layers is not None:
        cfg = copy.deepcopy(cfg)
        cfg.num_hidden_layers = layers

    def make(seq: int) -> torch.nn.Module:
        import transformers

        try:
            return transformers.AutoModelForCausalLM.from_config(cfg).train()
        except ValueError as e:
            raise MemplanError(f"config ({cfg.model_type}): transformers has no causal LM for it ({e})",
                               "unsupported") from e

    heads = getattr(cfg, "num_attention_heads", None)
    experts = max(int(getattr(cfg, k, 0) or 0) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
    name = f"{cfg.model_type} ({getattr(cfg, 'num_hidden_layers', '?')} layers x {getattr(cfg, 'hidden_size', '?')})"
    return Source("hf", name, make, heads, getattr(cfg, "num_key_value_heads", None) or heads, experts,
                  getattr(cfg, "vocab_size", None))


def torchtitan_source(flavor: str, layers: Optional[int] = None) -> Source:
    """torchtitan's Llama 3 of that flavor (``"debugmodel"``, ``"8B"``,
    ``"70B"``, ...; ``"llama3:8B"`` too), with `layers` blocks if given."""
    _require("torchtitan", "a torchtitan flavor")
    from torchtitan.models.llama3 import Transformer, llama3_args

    model, _, name = flavor.rpartition(":")
    if model not in ("", "llama3"):
        raise MemplanError(f"torchtitan model {model!r}: the estimate knows torchtitan's llama3 only", "unsupported")
    if name not in llama3_args:
        raise MemplanError(f"torchtitan flavor {name!r}: llama3's flavors are {', '.join(sorted(llama3_args))}")
    args = copy.deepcopy(llama3_args[name])
    if layers is not None:
        args.n_layers = layers

    def make(seq: int) -> torch.nn.Module:
        a = copy.deepcopy(args)
        a.max_seq_len = seq
        return Transformer(a)

    return Source("torchtitan", f"torchtitan llama3 {name} ({args.n_layers} layers x {args.dim})", make,
                  args.n_heads, args.n_kv_heads or args.n_heads, 0, args.vocab_size)


def class_source(model_class: Callable[..., torch.nn.Module], model_args: Dict[str, Any]) -> Source:
    def make(seq: int) -> torch.nn.Module:
        return model_class(**model_args).train()

    return Source("class", getattr(model_class, "__name__", str(model_class)), make,
                  model_args.get("num_attention_heads") or model_args.get("n_heads"),
                  model_args.get("num_key_value_heads") or model_args.get("n_kv_heads"), 0,
                  model_args.get("vocab_size"))


def _require(module: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MemplanError(f"{what} needs the {module} package: pip install {module}", "unsupported") from e


def blocks(model: torch.nn.Module) -> Tuple[str, Any]:
    """The model's repeated blocks FSDP2 wraps one by one: the module list
    (or dict) holding the most parameters, and its name."""
    best, best_n, best_name = None, 0, ""
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)) and len(m):
            n = sum(p.numel() for p in m.parameters())
            if n > best_n:
                best, best_n, best_name = m, n, name
    if best is None:
        raise MemplanError(f"{type(model).__name__}: no list of repeated blocks to wrap with fully_shard",
                           "unsupported")
    return best_name, best


def checkpoint(model: torch.nn.Module, source: Source, ac: str) -> None:
    """Activation checkpointing as torchtitan applies it (its
    ``ActivationCheckpoint`` defaults): ``"full"`` every block,
    ``"selective"`` every second block, ``"selective-op"`` torchtitan's
    op-level policy (every other matmul and the attention kept). Its
    ``apply_ac`` for its own model; for the others, the same function on
    each of the model's blocks."""
    if ac == "none":
        return
    _require("torchtitan", f"activation checkpointing {ac!r} (torchtitan's)")
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed import activation_checkpoint as titan_ac

    config = ActivationCheckpoint(mode="selective" if ac.startswith("selective") else ac)
    if ac == "selective-op":
        config.selective_ac_option = "op"
    if source.kind == "torchtitan":
        titan_ac.apply_ac(model, config)
        return
    _, holder = blocks(model)
    for key, block in list(holder.named_children()):
        holder.register_module(key, titan_ac._apply_ac_to_transformer_block(block, config, base_fqn=key))


def shard(model: torch.nn.Module, source: Source, mesh, mixed_precision: str) -> None:
    """FSDP2 as the framework wraps: torchtitan's ``apply_fsdp`` for its
    model (its reshard policy and summed gradients); else ``fully_shard``
    on each block, then the root, with the same precision policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param_dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    if source.kind == "torchtitan":
        from torchtitan.models.llama3.infra.parallelize import apply_fsdp

        apply_fsdp(model, mesh, param_dtype=param_dtype, reduce_dtype=torch.float32, pp_enabled=False)
        return
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed_precision == "bf16" else MixedPrecisionPolicy()
    _, holder = blocks(model)
    for block in holder.children():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def batch_and_loss(source: Source, micro_batch: int, seq: int, global_tokens: int):
    """The example batch (token ids) and the loss the framework trains
    with: torchtitan's cross-entropy summed over this rank's tokens and
    divided by the global token count, on ``seq + 1`` tokens; the Hugging
    Face model's own loss (a mean over this rank's tokens) otherwise."""
    if source.kind == "torchtitan":
        def titan_loss(m, b):
            from torchtitan.components.loss import cross_entropy_loss

            return cross_entropy_loss(m(b[:, :-1]), b[:, 1:]) / global_tokens

        return torch.zeros((micro_batch, seq + 1), dtype=torch.long), titan_loss

    def hf_loss(m, b):
        return m(input_ids=b, labels=b).loss

    return torch.zeros((micro_batch, seq), dtype=torch.long), hf_loss
