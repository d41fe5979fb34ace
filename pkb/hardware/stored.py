"""Calibrated hardware profiles on disk: where ``pkb calibrate`` stores them and how they are read back.

Apart from ``pkb.measure.calibrate`` (which measures and writes them) so that choosing a profile
(``pkb.hardware.detect``) needs nothing of the measuring code, and the layers stay acyclic.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

from pkb.hardware.profiles import HardwareProfile

FORMAT_VERSION = 1


def cache_dir() -> Path:
    if os.environ.get("PKB_CACHE_DIR"):
        return Path(os.environ["PKB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pkb"


def calibrated_path(gpu_model: str, num_gpus: int) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "_", gpu_model.lower()).strip("_")
    return cache_dir() / "hardware" / f"{slug}_x{num_gpus}.json"


def load_calibrated(gpu_model: str, num_gpus: int) -> HardwareProfile | None:
    """The calibrated profile stored for this GPU model and count, or None (an unreadable file warns)."""
    path = calibrated_path(gpu_model, num_gpus)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format_version {data.get('format_version')!r}, expected {FORMAT_VERSION}")
        return HardwareProfile.from_dict(data["profile"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"ignoring the calibrated profile {path} ({exc}); rerun `pkb calibrate` or delete the file",
                      stacklevel=2)
        return None
