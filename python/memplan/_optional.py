"""Optional dependencies, imported where a feature needs them: a missing
one is a :class:`memplan.MemplanError` (also an ``ImportError``) that says
which feature needs it and what to install, not a bare
``ModuleNotFoundError`` from deep inside the package."""

from __future__ import annotations

import importlib
from types import ModuleType

from . import MemplanError

# What to install for each optional dependency memplan imports.
INSTALL = {
    "torch": "pip install torch (or the build for your accelerator: https://pytorch.org/get-started/locally/)",
    "transformers": "pip install transformers",
    "torchvision": "pip install torchvision",
    "torchtitan": "pip install torchtitan",
    "jax": "pip install 'jax[cpu]' (or jax[cuda12] for GPUs)",
}


class MissingDependency(MemplanError, ImportError):
    """An optional package a memplan feature needs is not installed."""

    kind = "unsupported"


def require(module: str, feature: str) -> ModuleType:
    """`module` imported, or :class:`MissingDependency` naming `feature`
    (what needed it) and the command that installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        if e.name is not None and e.name.split(".")[0] != top:
            raise  # the package is there; something it imports is not
        how = INSTALL.get(top, f"pip install {top}")
        raise MissingDependency(f"{feature} needs {top}, which is not installed in this Python "
                                f"({e}): {how}") from e
