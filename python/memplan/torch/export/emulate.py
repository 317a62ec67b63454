"""Makes a step traced on ``meta`` run the ops a CUDA step would.

Without a GPU the step is traced on ``meta`` tensors. Most aten ops are the
same on both devices (autograd decides them above the device), but a few
choices are made per device below the dispatcher, where the recorder cannot
see them. :class:`CudaEmulation` makes those choices as PyTorch does on CUDA:

- ``scaled_dot_product_attention``: on ``meta`` PyTorch falls back to the
  math path, which materialises the ``[B, H, T, T]`` attention matrix. On a
  CUDA GPU (sm80 and newer) PyTorch picks FlashAttention for fp16/bf16
  inputs without an explicit mask and head dim at most 256, else the
  memory-efficient kernel (any float dtype, additive mask allowed), and keeps
  only the output and the log-sum-exp for backward. The emulation calls
  ``aten._scaled_dot_product_flash_attention`` or
  ``aten._scaled_dot_product_efficient_attention`` with the same rule, so
  autograd records their backward ops. A boolean mask is turned into an
  additive one first, as PyTorch does. Head dims that are not a multiple of
  8 keep the math path. The padding of the efficient kernel's log-sum-exp to
  a multiple of 32 rows is not modelled (it is a few KiB).
- dropout: on CUDA ``F.dropout`` in training runs the fused
  ``aten.native_dropout``, which saves a one-byte boolean mask for backward;
  elsewhere it draws a mask of the input's own dtype (``empty_like``,
  ``bernoulli_``, ``div_``, ``mul``), four times larger in f32. The
  emulation calls ``aten.native_dropout`` when PyTorch's CUDA build would
  (training, ``0 < p < 1``, a non-empty input, not in place).

:class:`EagerDataChecks` (used with meta and with fake tensors) answers
Hugging Face's one data-dependent question in a training step without an
attention mask: whether the position ids hold packed sequences
(``find_packed_sequence_indices`` reads a value with ``.all()``, which
``meta`` tensors cannot answer, and on fake tensors transformers assumes it is
being compiled). Our batches hold one sequence per row, so eager PyTorch
answers "no" (``None``); so does the patch, without running the check's few
small ops on the position ids.

The optimizer's implementation is chosen by the driver (``foreach=True``,
PyTorch's default on CUDA), not here.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

_SDPA = F.scaled_dot_product_attention
_DROPOUT = F.dropout


def emulated_dropout(input, p=0.5, training=True, inplace=False):
    if training and 0.0 < p < 1.0 and not inplace and input.numel() > 0:
        return torch.ops.aten.native_dropout(input, p, True)[0]
    return _DROPOUT(input, p, training, inplace)


def sdpa_backend(query: torch.Tensor, attn_mask, dropout_p: float) -> str:
    """The kernel PyTorch's CUDA dispatcher would pick: ``flash``,
    ``efficient`` or ``math``."""
    head_dim = query.shape[-1]
    if head_dim % 8 != 0:
        return "math"
    if query.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and head_dim <= 256:
        return "flash"
    if query.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return "efficient"
    return "math"


def emulated_sdpa(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    backend = sdpa_backend(query, attn_mask, dropout_p)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        backend = "math"
    if backend == "math" or query.dim() != 4:
        return _SDPA(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        )
    if backend == "flash":
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )
        return out[0]
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:
        bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill_(
            bias.logical_not(), float("-inf")
        )
    if bias is not None:
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value)
    )
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, needs_grad, dropout_p, is_causal, scale=scale
    )
    return out[0]


class CudaEmulation:
    """While active, attention calls take the kernels CUDA would take.

    It replaces ``torch.nn.functional.scaled_dot_product_attention`` and
    ``torch.nn.functional.dropout`` (module attributes, which both ``F.multi_head_attention_forward`` and
    Hugging Face's attention functions look up at call time) and restores it
    on exit. A ``TorchFunctionMode`` would not do: it is disabled while it
    runs a function, so it misses the attention call inside
    ``multi_head_attention_forward``.
    """

    def __enter__(self) -> "CudaEmulation":
        self._saved = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = emulated_sdpa
        F.dropout = emulated_dropout
        return self

    def __exit__(self, *exc) -> None:
        F.scaled_dot_product_attention = self._saved
        F.dropout = _DROPOUT


class EagerDataChecks:
    """While active, Hugging Face's one data-dependent check in a training
    step without an attention mask gets eager PyTorch's answer on meta and
    fake tensors (see the module docs): "no packed sequences". On fake
    tensors transformers would otherwise take the traced path (as under
    ``torch.compile``) and build an explicit causal mask that eager PyTorch
    does not build."""

    def __enter__(self) -> "EagerDataChecks":
        self._hf = sys.modules.get("transformers.masking_utils")
        if self._hf is not None:
            original = self._saved = self._hf.find_packed_sequence_indices

            def find_packed_sequence_indices(position_ids):
                if position_ids.device.type == "meta" or _is_fake(position_ids):
                    return None
                return original(position_ids)

            self._hf.find_packed_sequence_indices = find_packed_sequence_indices
        return self

    def __exit__(self, *exc) -> None:
        if self._hf is not None:
            self._hf.find_packed_sequence_indices = self._saved


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
