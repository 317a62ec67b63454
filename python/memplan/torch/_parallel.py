"""Which data parallelism a model uses: DDP (:mod:`._distributed`), FSDP2
(:mod:`._fsdp`) or none. The one module that knows both, so neither
imports the other."""

from __future__ import annotations

from typing import Optional

import torch

from ._distributed import DataParallel, RankGroup, _is_ddp, refuse_unsupported_wrappers
from ._fsdp import FullySharded


def rank_group(model: torch.nn.Module, timeout: float) -> Optional[RankGroup]:
    """The model's data parallelism: :class:`DataParallel` for a DDP model,
    :class:`FullySharded` for one whose root is sharded with
    ``fully_shard``, None for neither; refuses wrappers it cannot capture.
    `timeout`: each collective's, in seconds."""
    if not isinstance(timeout, (int, float)) or not (0 < timeout < float("inf")):
        raise ValueError(f"collective_timeout must be a positive number of seconds, not {timeout!r}")
    if _is_ddp(model):
        refuse_unsupported_wrappers(model.module)
        return DataParallel(model, timeout)
    sharded = FullySharded.of(model, timeout)
    if sharded is not None:
        return sharded
    refuse_unsupported_wrappers(model)
    return None
