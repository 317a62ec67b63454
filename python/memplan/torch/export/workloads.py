"""The export's workloads now live in the one catalogue,
:mod:`memplan.torch.workloads`; this name stays for ``--model
memplan.torch.export.workloads:...`` and imports of :class:`Workload`."""

from memplan.torch.workloads import (WORKLOADS, Workload, bert_base, gpt2, gpt2_xl, mlp, resnet50, resolve,
                                     tiny_attn, vit_b_16)

__all__ = ["WORKLOADS", "Workload", "bert_base", "gpt2", "gpt2_xl", "mlp", "resnet50", "resolve", "tiny_attn",
           "vit_b_16"]
