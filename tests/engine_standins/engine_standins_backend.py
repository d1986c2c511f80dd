"""The torch_gdr backend the engine stand-ins call (tests only): ``TORCH_GDR_ENGINE_BACKEND``
(``cpu`` or ``torch``; default ``cpu``), set by ``bench/run_engine_tests.py``."""

from __future__ import annotations

import os


def backend() -> str:
    return os.environ.get("TORCH_GDR_ENGINE_BACKEND", "cpu")
