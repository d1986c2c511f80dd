"""fla's own calls beside torch_gdr's defaults on the same inputs (used by gpu_check.py).

Sections, each returning printable lines:

- :func:`check_adapter`: torch_gdr's raw adapter (``torch_gdr.ops.fla``: fla's internal
  forward/backward) against fla's public ``chunk_gated_delta_rule`` (outputs, final state,
  every gradient; also with fla's activations in the kernels) and fla's fused recurrent
  against torch_gdr's step;
- :func:`time_against_fla`: forward and forward + backward at 1 x 32768 and 8 x 4096
  (H16/HV32, K = V = 128, bf16), fla's public call vs torch_gdr's default backend; decode
  (one token, B = 1 and 64) fla's fused recurrent vs torch_gdr's step and the chunked op;
  ratio = torch_gdr / fla (targets: <= 1.1 for the chunked calls, <= 1.3 for decode);
- :func:`check_compile`: ``torch.compile(fullgraph=True)`` of a step through
  ``backend="fla"`` (needs the backend registered).

``timer`` is a callable ``timer(fn) -> ms``: CUDA events on a GPU, wall clock in
``--smoke`` runs on a CPU.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

import torch_gdr
import torch_gdr.ops.fla as fla_backend
from torch_gdr._gating import Gating

# (B, T, H, HV, K = V)
CHUNK_SHAPES = {"1x32768 h16/32": (1, 32768, 16, 32, 128), "8x4096 h16/32": (8, 4096, 16, 32, 128)}
DECODE_BATCHES = (1, 64)
TARGET_CHUNKED, TARGET_DECODE = 1.1, 1.3

Timer = Callable[[Callable[[], object]], float]


def fla_public() -> tuple[Optional[Callable], Optional[Callable], Optional[str]]:
    """fla's public chunk and fused-recurrent functions, or the reason they are missing."""
    if not fla_backend.available():
        return None, None, fla_backend.load_reason()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, None


def step_function() -> Callable:
    """torch_gdr's public step (the device's default backend)."""
    return torch_gdr.fused_recurrent_gated_delta_rule


def make_inputs(batch: int, seq_len: int, heads: int, v_heads: int, dim: int, dtype: torch.dtype, device: str,
                seed: int = 0, with_state: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = dict(q=torch.randn(batch, seq_len, heads, dim, generator=gen),
             k=torch.randn(batch, seq_len, heads, dim, generator=gen),
             v=torch.randn(batch, seq_len, v_heads, dim, generator=gen),
             g=F.logsigmoid(torch.randn(batch, seq_len, v_heads, generator=gen)),
             beta=torch.sigmoid(torch.randn(batch, seq_len, v_heads, generator=gen)))
    x = {n: t.to(device=device, dtype=dtype) for n, t in x.items()}
    if with_state:
        x["initial_state"] = (torch.randn(batch, v_heads, dim, dim, generator=gen) * 0.05).to(device)
    return x


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double().cpu(), out.double().cpu()
    return ((ref - out).norm() / ref.norm().clamp_min(1e-30)).item()


def _raw_gating(num_v_heads: int, device: str, x: dict, gen: torch.Generator) -> dict:
    """fla's activation arguments, all on (raw gate, A_log, dt_bias, beta logits, neg eigvals),
    with ``x``'s g and beta replaced by raw values in place."""
    x["g"] = (2.0 * torch.randn(x["g"].shape, generator=gen)).to(device, x["g"].dtype)
    x["beta"] = (2.0 * torch.randn(x["beta"].shape, generator=gen)).to(device, x["beta"].dtype)
    a_log = torch.empty(num_v_heads).uniform_(0.05, 2.0, generator=gen).log()
    return dict(use_gate_in_kernel=True, A_log=a_log.to(device), dt_bias=torch.randn(num_v_heads, generator=gen).to(device),
                use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)


def check_adapter(device: str, bound: float = 2e-3, seq_lens: tuple = (300, 1, 399), heads: tuple = (4, 8),
                  dim: int = 128, decode_batch: int = 64, gated: bool = False) -> list[str]:
    """The adapter's forward + backward against fla's public call, and the two steps;
    ``gated``: with fla's activation arguments (raw gate, A_log, dt_bias, beta logits), whose
    gradients are compared too."""
    chunk, fused, reason = fla_public()
    if chunk is None:
        return [f"fla adapter: skipped ({reason})"]
    x = make_inputs(1, sum(seq_lens), *heads, dim, torch.bfloat16, device, seed=3, with_state=True)
    cu = torch.tensor((0,) + seq_lens, device=device).cumsum(0)
    x["initial_state"] = x["initial_state"][:1].expand(len(seq_lens), -1, -1, -1).contiguous()
    scale = dim ** -0.5
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(x["v"].shape, generator=gen).to(device, torch.bfloat16)
    dht = torch.randn(x["initial_state"].shape, generator=gen).to(device)
    gating = _raw_gating(heads[1], device, x, gen) if gated else {}
    params = {n: t for n, t in gating.items() if isinstance(t, torch.Tensor)}

    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    param_leaves = {n: t.detach().clone().requires_grad_() for n, t in params.items()}
    label = "bf16, varlen" + (", fla's activations" if gated else "")
    try:
        o_ref, s_ref = chunk(**leaves, scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=True,
                             cu_seqlens=cu, **dict(gating, **param_leaves))
        ref_grads = torch.autograd.grad((o_ref.float() * do.float()).sum() + (s_ref * dht).sum(),
                                        list(leaves.values()) + list(param_leaves.values()))
    except RuntimeError as exc:  # e.g. fla's gated backward refused on Hopper with Triton < 3.7.1
        return [f"fla adapter ({label}): skipped, fla's public call raised {str(exc).splitlines()[0][:200]}"]

    o, s, *saved = fla_backend.fla_chunk_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"],
                                             True, True, cu, 64, Gating(**gating))
    grads = fla_backend.fla_chunk_bwd(do, dht, x["q"], x["k"], x["v"], x["g"], x["beta"], *saved, scale,
                                      x["initial_state"], True, cu, 64, Gating(**gating))
    grads = list(grads[:5]) + [grads[5]] + [d for d in grads[6:] if d is not None]
    errs = {"o": rel_err(o_ref, o), "state": rel_err(s_ref, s)}
    errs.update({f"d{n}": rel_err(r, g) for n, r, g in zip(list(x) + list(params), ref_grads, grads)})
    worst = max(errs.values())
    lines = [f"fla adapter vs fla's chunk_gated_delta_rule ({label}): worst rel err {worst:.1e} "
             f"{'OK' if worst < bound else 'FAIL'}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())]
    if gated:
        return lines

    d = make_inputs(decode_batch, 1, *heads, dim, torch.bfloat16, device, seed=5, with_state=True)
    o_fla, s_fla = fused(d["q"], d["k"], d["v"], g=d["g"], beta=d["beta"], initial_state=d["initial_state"],
                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ours, s_ours = step_function()(**d, output_final_state=True, use_qk_l2norm_in_kernel=True)
    errs = {"o": rel_err(o_fla, o_ours), "state": rel_err(s_fla, s_ours)}
    worst = max(errs.values())
    lines.append(f"torch_gdr step vs fla's fused recurrent (bf16, B={decode_batch} decode): worst rel err {worst:.1e} "
                 f"{'OK' if worst < bound else 'FAIL'}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    return lines


def _default_backend_name(device: str) -> str:
    try:
        from torch_gdr.dispatch import resolve_backend

        return resolve_backend(None, torch.device(device))
    except Exception as exc:  # noqa: BLE001 - only a label
        return f"? ({type(exc).__name__})"


def time_against_fla(device: str, timer: Timer, chunk_shapes: dict = CHUNK_SHAPES,
                     decode_batches: tuple = DECODE_BATCHES, decode_heads: tuple = (16, 32, 128)) -> list[str]:
    chunk, fused, reason = fla_public()
    lines = [f"torch_gdr default backend on {device}: {_default_backend_name(device)}"]
    if chunk is None:
        lines.append(f"fla timings: fla side skipped ({reason})")
    header = f"{'work':<34}{'fla ms':>9}{'torch_gdr ms':>14}{'ratio':>8}  target"
    lines.append(header)

    def row(work: str, fla_ms: Optional[float], ours_ms: float, target: float) -> None:
        if fla_ms is None:
            lines.append(f"{work:<34}{'-':>9}{ours_ms:>14.3f}{'-':>8}")
            return
        ratio = ours_ms / fla_ms
        lines.append(f"{work:<34}{fla_ms:>9.3f}{ours_ms:>14.3f}{ratio:>7.2f}x  <= {target:g} "
                     f"{'holds' if ratio <= target else 'MISSED'}")

    for name, (b, t, h, hv, d) in chunk_shapes.items():
        x = make_inputs(b, t, h, hv, d, torch.bfloat16, device)
        kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
        impls = {"torch_gdr": lambda z: torch_gdr.chunk_gated_delta_rule(**z, **kw)}
        if chunk is not None:
            impls["fla"] = lambda z: chunk(**z, **kw)
        fwd, fwd_bwd = {}, {}
        for impl_name, impl in impls.items():
            leaves = {n: v.detach().requires_grad_() for n, v in x.items()}

            def forward(impl=impl) -> None:
                with torch.no_grad():
                    impl(x)

            def forward_backward(impl=impl, leaves=leaves) -> None:
                o, s = impl(leaves)
                (o.float().sum() + s.sum()).backward()
                for v in leaves.values():
                    v.grad = None

            fwd[impl_name], fwd_bwd[impl_name] = timer(forward), timer(forward_backward)
        row(f"forward {name}", fwd.get("fla"), fwd["torch_gdr"], TARGET_CHUNKED)
        row(f"forward + backward {name}", fwd_bwd.get("fla"), fwd_bwd["torch_gdr"], TARGET_CHUNKED)
        del x

    step = step_function()
    for b in decode_batches:
        x = make_inputs(b, 1, *decode_heads, torch.bfloat16, device, with_state=True)
        kw = dict(initial_state=x["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True)
        args = (x["q"], x["k"], x["v"])
        with torch.no_grad():
            fla_ms = None if fused is None else timer(lambda: fused(*args, g=x["g"], beta=x["beta"], **kw))
            row(f"decode B={b}, step", fla_ms, timer(lambda: step(*args, x["g"], x["beta"], **kw)), TARGET_DECODE)
            row(f"decode B={b}, chunked op at T=1", fla_ms,
                timer(lambda: torch_gdr.chunk_gated_delta_rule(*args, x["g"], x["beta"], chunk_size=16, **kw)),
                TARGET_DECODE)
    return lines


def check_compile(device: str) -> list[str]:
    """A fullgraph-compiled training step (forward + backward) through ``backend="fla"``."""
    x = make_inputs(2, 256, 2, 4, 64, torch.bfloat16, device, with_state=True)
    leaves = {n: v.detach().requires_grad_() for n, v in x.items()}

    def step(z):
        o, s = torch_gdr.chunk_gated_delta_rule(**z, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                backend="fla")
        return o.float().sum() + s.sum()

    try:
        eager = torch.autograd.grad(step(leaves), list(leaves.values()))
        compiled = torch.compile(step, fullgraph=True)
        grads = torch.autograd.grad(compiled(leaves), list(leaves.values()))
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the other sections still count
        return [f"fullgraph compile through backend='fla': FAIL ({type(exc).__name__}: {str(exc).splitlines()[0]})"]
    worst = max(rel_err(e, c) for e, c in zip(eager, grads))
    return [f"fullgraph compile through backend='fla': {'OK' if worst < 1e-2 else 'FAIL'} "
            f"(compiled vs eager gradients, worst rel err {worst:.1e})"]
