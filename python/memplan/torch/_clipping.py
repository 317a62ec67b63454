"""Gradient clipping as :func:`memplan.torch.capture` records it
(``clip_grad_norm=``, ``clip_grad_value=``): the policy, checked where it is
made (:class:`Clipping`), and the recording of PyTorch's own
``clip_grad_norm_`` and ``clip_grad_value_`` kernels on one rank's
gradients. Data parallelism records clipping by norm itself
(``DataParallel.clip_norm``: FSDP2's shards reduce their norms first).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Dict, Optional

import torch

from memplan import MemplanError

from ._record import Recorder


@dataclasses.dataclass(frozen=True)
class Clipping:
    """How the step clips its gradients between the backward pass and the
    update: by their total `norm_type`-norm to `limit` (``kind="norm"``,
    ``clip_grad_norm_``), or each element to ``[-limit, limit]``
    (``kind="value"``, ``clip_grad_value_``). Refuses, by the option's
    name, a limit that is not a finite number ≥ 0 and a norm type that is
    not a number > 0 (``inf`` is the largest element): PyTorch would run
    them, a negative limit flipping every gradient."""

    kind: str
    limit: float
    norm_type: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in ("norm", "value"):
            raise MemplanError(f"clipping is by 'norm' or by 'value', not {self.kind!r}")
        option = "clip_grad_norm" if self.kind == "norm" else "clip_grad_value"
        if not _number(self.limit) or not math.isfinite(self.limit) or self.limit < 0:
            raise MemplanError(f"{option} must be a finite number >= 0, not {self.limit!r}")
        if not _number(self.norm_type) or math.isnan(self.norm_type) or self.norm_type <= 0:
            raise MemplanError(f"norm_type must be a number > 0 (inf for the largest element), not "
                               f"{self.norm_type!r}")

    @staticmethod
    def of(clip_grad_norm=None, norm_type=2.0, clip_grad_value=None) -> Optional["Clipping"]:
        """The policy of capture's options (None without clipping)."""
        if clip_grad_norm is not None and clip_grad_value is not None:
            raise TypeError("give either clip_grad_norm or clip_grad_value")
        if clip_grad_norm is not None:
            return Clipping("norm", clip_grad_norm, norm_type)
        if clip_grad_value is not None:
            return Clipping("value", clip_grad_value)
        return None

    def record(self, rec: Recorder, fp: Dict[str, torch.Tensor], grad_of: Dict[str, torch.Tensor]) -> Optional[int]:
        """Records the clipping of one rank's gradients `grad_of` (of the
        fake parameters `fp`); returns the total norm's graph tensor when
        clipping by norm."""
        if self.kind == "norm":
            return _clip_norm(rec, fp, grad_of, self.limit, self.norm_type)
        _clip_values(grad_of, self.limit)
        return None


def _number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _clip_norm(rec: Recorder, fp: Dict[str, torch.Tensor], grad_of: Dict[str, torch.Tensor], max_norm: float,
               norm_type: float) -> int:
    """Records ``torch.nn.utils.clip_grad_norm_`` over the gradients (held
    as the fake parameters' ``.grad`` for the call): the norms, their total
    and each gradient scaled in place. Returns the total's graph tensor."""
    names = list(grad_of)
    # Eager PyTorch takes the foreach kernels for CUDA (and CPU) tensors,
    # but not for fake ones: ask for them where they are fused kernels
    # (CUDA), so the step rounds as eager does. On the CPU they loop over
    # the per-tensor kernels, which are what is recorded.
    foreach = True if rec.device == "cuda" else None
    try:
        for n in names:
            fp[n].grad = grad_of[n]
        total = torch.nn.utils.clip_grad_norm_([fp[n] for n in names], max_norm, norm_type, foreach=foreach)
    finally:
        for n in names:
            fp[n].grad = None
    return rec.table.mark(total, "output", persistent=True)


def _clip_values(grad_of: Dict[str, torch.Tensor], clip_value: float) -> None:
    """Records ``torch.nn.utils.clip_grad_value_``: the kernels it calls on
    lists of gradients (``_foreach_clamp_min_``, ``_foreach_clamp_max_``),
    called on one gradient at a time (elementwise: the same bits), so no
    gradient waits for another."""
    c = float(clip_value)
    with torch.no_grad():
        for g in grad_of.values():
            torch._foreach_clamp_min_([g], -c)
            torch._foreach_clamp_max_([g], c)
