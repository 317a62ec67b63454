"""Export a PyTorch training step as a memplan graph.

``python -m memplan.torch.export --model resnet50 --batch 32 -o resnet50.json.gz``
records one full training step (forward, loss, ``backward()``,
``optimizer.step()``) at the aten level and writes memplan's JSON graph.
See ``docs/torch-export.md``.

Modules: :mod:`.graph` (the file format, torch-free), :mod:`.recorder` (the
``TorchDispatchMode`` that turns aten ops into ops and storages into
tensors), :mod:`.emulate` (CUDA kernel choices when tracing on ``meta``),
:mod:`.workloads` (models built from configs), :mod:`.step` (warm-up, traced
step, real measurement). Importing this package does not import torch.
"""
