"""Where the upstream benchmark's files are: ``../shared/upstream`` beside the project's root, or the folder
``PKB_UPSTREAM_DIR`` names (a machine whose checkout has no ``shared/`` beside it, e.g. a device node)."""

from __future__ import annotations

import os
from pathlib import Path

UPSTREAM = Path(os.environ.get("PKB_UPSTREAM_DIR") or Path(__file__).resolve().parents[3] / "shared" / "upstream")
UPSTREAM_REFERENCE = UPSTREAM / "reference"
