"""Files every layer writes: JSON written atomically (a reader never sees half a file)."""
from __future__ import annotations

import json
import os
import tempfile


def write_json(obj, path: str) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically: a hidden temporary file beside it, renamed into place,
    so a reader never sees half a file (values JSON cannot hold are written as their ``str``)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(obj, indent=1, default=str) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
