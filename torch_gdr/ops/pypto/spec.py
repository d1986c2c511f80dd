"""What the PyPTO kernels serve: head dims, chunk sizes, dtypes, devices. Every other module
reads these constants from here."""

from __future__ import annotations

import torch

#: Head dims K and V the kernels are written and tested for.
HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
#: Chunk lengths the kernels offer, smallest first.
CHUNK_SIZES: tuple[int, ...] = (32, 64, 128)
#: Input dtypes the kernels take (they compute in float32).
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
#: Most tokens per sequence the decode kernel takes in one pool step (S of
#: ``ssm_state_indices [N, S]``: the speculative verification width).
MAX_STEP_TOKENS: int = 16
