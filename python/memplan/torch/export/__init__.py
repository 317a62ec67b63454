"""Export a PyTorch training step as a memplan graph.

``python -m memplan.torch.export --model resnet50 --batch 32 -o resnet50.json.gz``
records one full training step (forward, loss, ``backward()``,
``optimizer.step()``) and writes memplan's JSON graph. See
``docs/torch-export.md``.

The export is a command over :func:`memplan.torch.capture` with
``plan=False`` (the graph memplan.torch plans and runs), or, with
``--update eager``, eager's own optimizer step recorded by the same recorder
(:class:`memplan.torch._record.Recorder`) as a baseline.

Modules: :mod:`.graph` (graph files; checks through memplan's core),
:mod:`.emulate` (CUDA kernel choices when tracing on ``meta``),
:mod:`.step` (the recorded
step in either mode, and the real measurement). Importing this package
does not import torch. The named workloads are
:mod:`memplan.torch.export.workloads`, the catalogue the benchmarks share.
"""
