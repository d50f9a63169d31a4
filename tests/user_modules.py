"""A user's module for the tests: written to a folder on sys.path, imported by reference like a user's
``package.module:ATTR``, and everything it registered (kernel sets, presets, import and validation memos) removed
afterwards."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

from exactness import config
from exactness.analysis.contract import validate
from exactness.kernels import KERNEL_SETS, imported


@contextmanager
def user_module(folder: Path, name: str, source: str):
    """``folder/name.py`` holding ``source``, importable while the context lasts; yields its path."""
    path = folder / f"{name}.py"
    path.write_text(source)
    sys.path.insert(0, str(folder))
    sets, presets = dict(KERNEL_SETS), dict(config.PRESETS)
    try:
        yield path
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(name, None)
        for k in [k for k in KERNEL_SETS if k not in sets]:
            KERNEL_SETS.pop(k)
            imported._DROPPED.pop(k, None)
            validate._VALIDATED.difference_update({v for v in validate._VALIDATED if v[0] == k})
        for k in [k for k in config.PRESETS if k not in presets]:
            config.PRESETS.pop(k)
        for k in [k for k in config._IMPORTED if k.startswith(name)]:
            config._IMPORTED.pop(k)
        for k in [k for k in imported._IMPORTED if k.startswith(name)]:
            imported._REFS.pop(imported._IMPORTED.pop(k).name, None)
