"""A stand-in for fla-core 0.6.0, in pure torch, for testing torch_gdr's fla adapter on CPUs.

It has the modules and the exact signatures of the functions the adapter calls, and their
conventions: the forward returns g cumulated within chunks in base-2 units (fla's
``RCP_LN2`` scale) and the backward takes that back (it recovers the raw g from it, so
passing anything else gives wrong gradients); ``A`` is ``[B, T, HV, BT]`` in k's dtype;
q/k arrive l2-normalised by the adapter (fla's ``l2norm_fwd``/``l2norm_bwd``). The
numbers come from the float64 per-token recurrence, not from fla's algorithm.
"""

from __future__ import annotations

import math
import types
from typing import Optional

import torch

from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule, naive_recurrent_gated_delta_rule_bwd

RCP_LN2 = 1.0 / math.log(2.0)
HOPPER_MESSAGE = ("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated chunk_bwd_dqkwg "
                  "(see #640). Please upgrade Triton to >= 3.7.1 or install tilelang: `pip install tilelang`")


def _spans(num_tokens: int, batch: int, cu_seqlens: Optional[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, num_tokens) for b in range(batch)]
    bounds = cu_seqlens.tolist()
    return [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]


def _chunk_cumsum(g: torch.Tensor, chunk_size: int, cu_seqlens) -> torch.Tensor:
    out = torch.empty(g.shape, dtype=torch.float32)
    for b, start, end in _spans(g.shape[1], g.shape[0], cu_seqlens):
        for c0 in range(start, end, chunk_size):
            c1 = min(end, c0 + chunk_size)
            out[b, c0:c1] = g[b, c0:c1].double().cumsum(0).float() * RCP_LN2
    return out


def _raw_g(g_cumsum: torch.Tensor, chunk_size: int, cu_seqlens) -> torch.Tensor:
    raw = torch.empty(g_cumsum.shape, dtype=torch.float64)
    for b, start, end in _spans(g_cumsum.shape[1], g_cumsum.shape[0], cu_seqlens):
        for c0 in range(start, end, chunk_size):
            c1 = min(end, c0 + chunk_size)
            block = g_cumsum[b, c0:c1].double() / RCP_LN2
            raw[b, c0:c1] = torch.cat([block[:1], block[1:] - block[:-1]])
    return raw


def _gate(raw: torch.Tensor, A_log: torch.Tensor, dt_bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's gate, float64: ``(-exp(A_log) softplus(raw + dt_bias), its slope in raw)``, with
    fla's softplus (the identity above 20)."""
    x = raw.double() + (0.0 if dt_bias is None else dt_bias.double())
    rate = A_log.double().exp()
    softplus = torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp(max=20.0))))
    slope = torch.where(x > 20.0, torch.ones_like(x), torch.sigmoid(x))
    return -rate * softplus, -rate * slope


class Behaviour:
    """Knobs a test turns: the version, and exceptions to raise."""

    def __init__(self) -> None:
        self.version = "0.6.0"
        self.forward_error: Optional[BaseException] = None
        self.backward_error: Optional[BaseException] = None
        self.calls: list[str] = []


def build(behaviour: Behaviour) -> dict[str, types.ModuleType]:
    """The stand-in's modules by name, ready for ``sys.modules``."""

    def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first=False,
                                   cu_seqlens=None, cp_context=None, chunk_indices=None, use_gate_in_kernel=False,
                                   A_log=None, dt_bias=None, chunk_size=64):
        behaviour.calls.append("fwd")
        if behaviour.forward_error is not None:
            raise behaviour.forward_error
        assert chunk_size in (16, 32, 64) and not state_v_first and cp_context is None
        assert (chunk_indices is None) == (cu_seqlens is None)
        assert all(t.is_contiguous() for t in (q, k, v, g, beta))
        assert (A_log is not None) == use_gate_in_kernel and (dt_bias is None or use_gate_in_kernel)
        g_input = g if use_gate_in_kernel else None
        if use_gate_in_kernel:  # fla activates the raw gate in its chunk cumsum kernel
            behaviour.calls.append("fwd gate in kernel")
            g = _gate(g, A_log, dt_bias)[0]
        g_cumsum = _chunk_cumsum(g, chunk_size, cu_seqlens)
        o, final_state = naive_recurrent_gated_delta_rule(
            q.double(), k.double(), v.double(), g.double(), beta.double(), scale,
            None if initial_state is None else initial_state.double(), True, False, cu_seqlens)
        A = beta.to(k.dtype)[..., None].expand(*beta.shape, chunk_size).contiguous()
        return (g_cumsum, o.to(v.dtype), A, final_state.float() if output_final_state else None, initial_state,
                g_input)

    def chunk_gated_delta_rule_bwd(q, k, v, g, beta, A, scale, initial_state, do, dht, state_v_first=False,
                                   cu_seqlens=None, cp_context=None, chunk_indices=None, use_gate_in_kernel=False,
                                   g_input=None, A_log=None, dt_bias=None, chunk_size=64):
        behaviour.calls.append("bwd")
        if behaviour.backward_error is not None:
            raise behaviour.backward_error
        assert A.shape == tuple(beta.shape) + (chunk_size,) and A.dtype == k.dtype
        assert g.dtype == torch.float32 and (chunk_indices is None) == (cu_seqlens is None)
        # the reverse recurrence, not autograd: this runs inside an op, where autograd is off
        inputs = [t.detach().double() for t in (q, k, v, _raw_g(g, chunk_size, cu_seqlens), beta)]
        h0 = None if initial_state is None else initial_state.detach().double()
        grads = naive_recurrent_gated_delta_rule_bwd(do.double(), None if dht is None else dht.double(), *inputs,
                                                     scale, h0, False, cu_seqlens)
        dq, dk, dv, dg, db = (t.float() for t in grads[:5])
        dh0 = grads[5].float() if h0 is not None else None
        d_a_log = d_dt_bias = None
        if use_gate_in_kernel:  # fla's gdn_gate_bwd: the raw gate's gradient, summed ones for A_log, dt_bias
            behaviour.calls.append("bwd gate in kernel")
            assert g_input is not None and A_log is not None
            gate, slope = _gate(g_input, A_log, dt_bias)
            d_a_log = (grads[3] * gate).flatten(0, -2).sum(0).to(A_log.dtype)
            dg = (grads[3] * slope).to(g_input.dtype)
            d_dt_bias = None if dt_bias is None else dg.double().flatten(0, -2).sum(0).to(dt_bias.dtype)
        return dq, dk, dv, db, dg, dh0, d_a_log, d_dt_bias

    def fused_recurrent_gated_delta_rule_fwd(q, k, v, g=None, gk=None, gv=None, beta=None, A_log=None,
                                             dt_bias=None, scale=None, initial_state=None, output_final_state=False,
                                             use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                                             allow_neg_eigval=False, state_v_first=False, cu_seqlens=None):
        behaviour.calls.append("fused_recurrent")
        if behaviour.forward_error is not None:
            raise behaviour.forward_error
        assert gk is None and gv is None and not state_v_first
        if A_log is not None:  # fla's gate in the kernel
            behaviour.calls.append("fused_recurrent gate in kernel")
            g = _gate(g, A_log, dt_bias)[0]
        if use_beta_sigmoid_in_kernel:
            beta = (2.0 if allow_neg_eigval else 1.0) * torch.sigmoid(beta.double())
        o, final_state = naive_recurrent_gated_delta_rule(
            q.double(), k.double(), v.double(), g.double(), beta.double(), scale,
            None if initial_state is None else initial_state.double(), True, use_qk_l2norm_in_kernel, cu_seqlens)
        return o.to(v.dtype), final_state.float() if output_final_state else None

    def fused_beta_sigmoid_fwd(x, scale=1.0):
        behaviour.calls.append("beta sigmoid")
        return (scale * torch.sigmoid(x.double())).float()

    def fused_beta_sigmoid_bwd(x, dy, scale=1.0):
        behaviour.calls.append("beta sigmoid bwd")
        sig = torch.sigmoid(x.double())
        return (dy.double() * scale * sig * (1.0 - sig)).to(x.dtype)

    def l2norm_fwd(x, eps=1e-6, output_dtype=None):
        rstd = torch.rsqrt(x.float().pow(2).sum(-1) + eps)
        return (x.float() * rstd[..., None]).to(output_dtype or x.dtype), rstd

    def l2norm_bwd(y, rstd, dy, eps=1e-6):
        y32, dy32 = y.float(), dy.float()
        dx = dy32 * rstd[..., None] - (dy32 * y32).sum(-1, keepdim=True) * y32 * rstd[..., None]
        return dx.to(y.dtype)

    def prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=None):
        bounds = cu_seqlens.tolist()
        rows = [(n, c) for n in range(len(bounds) - 1)
                for c in range(-(-(bounds[n + 1] - bounds[n]) // chunk_size))]
        return torch.tensor(rows, dtype=cu_seqlens.dtype).view(-1, 2)

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                               state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                               cp_context=None, **kwargs):
        """fla's public chunked call (differentiable), by the recurrence; fla's activations in torch."""
        behaviour.calls.append("public chunk")
        if use_qk_l2norm_in_kernel:  # as fla: normalised q, k rounded to their dtype, then the kernels
            q, k = (l2norm_fwd(x)[0] for x in (q, k))
        if kwargs.get("use_gate_in_kernel"):
            dt_bias = kwargs.get("dt_bias")
            g = -kwargs["A_log"].double().exp() * torch.nn.functional.softplus(
                g.double() + (0.0 if dt_bias is None else dt_bias.double()))
        if use_beta_sigmoid_in_kernel:
            beta = (2.0 if allow_neg_eigval else 1.0) * torch.sigmoid(beta.double())
        o, final_state = naive_recurrent_gated_delta_rule(q.double(), k.double(), v.double(), g.double(),
                                                          beta.double(), scale,
                                                          None if initial_state is None else initial_state.double(),
                                                          True, False, cu_seqlens)
        return o.to(q.dtype), final_state.float() if output_final_state else None

    def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                         initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                                         use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                         use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                                         state_v_first=False, cu_seqlens=None, **kwargs):
        """fla's public fused-recurrent call (0.6's order: gk, gv before beta)."""
        assert gk is None and gv is None, "beta passed positionally lands on gk in fla 0.6"
        return fused_recurrent_gated_delta_rule_fwd(q, k, v, g=g, beta=beta, scale=scale or k.shape[-1] ** -0.5,
                                                    A_log=A_log if use_gate_in_kernel else None,
                                                    dt_bias=dt_bias if use_gate_in_kernel else None,
                                                    initial_state=initial_state,
                                                    output_final_state=output_final_state,
                                                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                    use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                                    allow_neg_eigval=allow_neg_eigval, cu_seqlens=cu_seqlens)

    def module(name: str, **attrs) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    modules = {
        "fla": module("fla", __version__=behaviour.version),
        "fla.ops": module("fla.ops"),
        "fla.ops.gated_delta_rule": module("fla.ops.gated_delta_rule", chunk_gated_delta_rule=chunk_gated_delta_rule,
                                           fused_recurrent_gated_delta_rule=fused_recurrent_gated_delta_rule),
        "fla.ops.gated_delta_rule.chunk": module("fla.ops.gated_delta_rule.chunk",
                                                 chunk_gated_delta_rule_fwd=chunk_gated_delta_rule_fwd,
                                                 chunk_gated_delta_rule_bwd=chunk_gated_delta_rule_bwd),
        "fla.ops.gated_delta_rule.fused_recurrent": module(
            "fla.ops.gated_delta_rule.fused_recurrent",
            fused_recurrent_gated_delta_rule_fwd=fused_recurrent_gated_delta_rule_fwd),
        "fla.modules": module("fla.modules"),
        "fla.modules.norm": module("fla.modules.norm"),
        "fla.modules.norm.l2norm": module("fla.modules.norm.l2norm", l2norm_fwd=l2norm_fwd, l2norm_bwd=l2norm_bwd),
        "fla.ops.common": module("fla.ops.common"),
        "fla.ops.common.gate": module("fla.ops.common.gate", fused_beta_sigmoid_fwd=fused_beta_sigmoid_fwd,
                                      fused_beta_sigmoid_bwd=fused_beta_sigmoid_bwd),
        "fla.ops.utils": module("fla.ops.utils"),
        "fla.ops.utils.index": module("fla.ops.utils.index", prepare_chunk_indices=prepare_chunk_indices),
        "fla.utils": module("fla.utils", IS_NVIDIA_HOPPER=False, TRITON_ABOVE_3_4_0=True, TRITON_ABOVE_3_7_1=True),
    }
    for name, m in modules.items():  # parents expose their children, as packages do
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(modules[parent], child, m)
            modules[parent].__path__ = []
    return modules
