"""Layers built on the op: the Gated DeltaNet token mixer and its decode cache.

    layer = torch_gdr.nn.GatedDeltaNet(hidden_size=1024, num_heads=8, num_v_heads=16,
                                       head_k_dim=128, head_v_dim=128)
    y = layer(x)                                     # [B, T, 1024]
"""

from torch_gdr.nn.cache import GatedDeltaNetCache, LayerState
from torch_gdr.nn.gated_deltanet import GatedDeltaNet
from torch_gdr.nn.norm import GatedRMSNorm
from torch_gdr.nn.pool_cache import GatedDeltaNetPoolBatch, GatedDeltaNetPoolCache
from torch_gdr.nn.short_conv import ShortConvolution, causal_depthwise_conv1d

__all__ = ["GatedDeltaNet", "GatedDeltaNetCache", "GatedDeltaNetPoolBatch", "GatedDeltaNetPoolCache", "GatedRMSNorm", "LayerState", "ShortConvolution",
           "causal_depthwise_conv1d"]
