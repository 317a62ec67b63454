"""The package's refusal of a step it cannot run in another order."""

from memplan import MemplanError


class UnsupportedStep(MemplanError):
    """A step memplan cannot run in another order; the message names the
    op and says why. A :class:`memplan.MemplanError` (a ``ValueError``),
    as every refusal of the package is, of kind ``"unsupported"``."""

    kind = "unsupported"

