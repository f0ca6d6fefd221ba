"""Where k31 keeps what it writes at run time."""

from __future__ import annotations

import os
from pathlib import Path


def state_dir() -> Path:
    return Path(os.environ.get("K31_STATE_DIR", ".k31")).resolve()
