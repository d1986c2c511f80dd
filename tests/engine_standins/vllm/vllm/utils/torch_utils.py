"""Stand-in for ``vllm.utils.torch_utils`` (tests only)."""

import random

import numpy as np
import torch


def set_random_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
