"""Whether a file named in the config can be read."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be read as a file, or None: 'no such file', 'is a directory, not a file', ... (a
    FIFO or a device is refused before anything opens it: reading one could block or never end)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "no such file"
    except NotADirectoryError:
        return "no such file (a folder on its way is a file)"
    except OSError as exc:
        return f"cannot read ({exc.strerror or exc})"
    except ValueError:
        return "not a valid path"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory, not a file"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        return f"cannot read ({exc.strerror or exc})"
    return None
