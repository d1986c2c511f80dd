"""Where torch_gdr keeps files of its own: one cache directory for every backend.

Kept free of torch_gdr imports (and of torch) so that any layer, and ``setup.py``'s helpers,
can use it without pulling in the package.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Environment variable that overrides the cache directory.
CACHE_DIR_ENV = "TORCH_GDR_CACHE_DIR"


def cache_dir() -> Path:
    """Root of torch_gdr's cache: ``$TORCH_GDR_CACHE_DIR`` or ``~/.cache/torch_gdr``.

    Read at each call, so a test or an application may point it elsewhere at any time.
    """
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "torch_gdr")
    return Path(root)
