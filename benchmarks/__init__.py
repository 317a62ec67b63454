"""memplan's benchmarks: PyTorch eager as experts configure it, torch.compile,
DDP and FSDP2 per rank, and the split loss chain, against memplan's planned
and fitted steps. Run from the repository root, with the package installed
in ``.venv`` (``scripts/python_tests.sh`` builds it there)::

    .venv/bin/python -m benchmarks.bench --help
    .venv/bin/python -m benchmarks.bench_baselines --models hf-gpt2,hf-llama --size small

They are not part of the installed ``memplan`` package. Each module's
docstring says what it measures; docs/benchmarks.md holds the results.
"""

import os

# The folder holding this package: child processes the benchmarks spawn
# (``python -m benchmarks.X``) find it on their PYTHONPATH.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(env=None):
    """`env` (this process's environment by default) with the repository
    first on ``PYTHONPATH``, for a ``python -m benchmarks...`` child."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


def largest_batch(fits, upto: int) -> int:
    """The largest batch ``b <= upto`` with ``fits(b)``, assuming that a
    batch that does not fit has no larger one that does: batches doubled
    from 1 until one does not fit (or passes `upto`), then the gap bisected.
    0 when batch 1 does not fit."""
    good, b = 0, 1
    while b <= upto and fits(b):
        good, b = b, b * 2
    if good and b <= upto:
        bad = b
        while bad - good > 1:
            mid = (good + bad) // 2
            if fits(mid):
                good = mid
            else:
                bad = mid
    return good
