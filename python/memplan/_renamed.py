"""Dicts whose keys were renamed: the old key still reads, for one release,
with a `DeprecationWarning` that names the new one."""

import warnings


class Renamed(dict):
    """A dict that also answers each old key in `renamed` (old -> new) with
    the new key's value, and warns."""

    def __init__(self, values, renamed):
        super().__init__(values)
        self._renamed = dict(renamed)

    def _new(self, key):
        new = self._renamed.get(key)
        if new is not None and not super().__contains__(key):
            warnings.warn(f"{key!r} is deprecated: use {new!r}", DeprecationWarning, stacklevel=3)
            return new
        return key

    def __getitem__(self, key):
        return super().__getitem__(self._new(key))

    def get(self, key, default=None):
        return super().get(self._new(key), default)

    def __contains__(self, key):
        if super().__contains__(key):
            return True
        new = self._renamed.get(key)
        return new is not None and super().__contains__(new)
