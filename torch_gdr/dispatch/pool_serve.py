"""Decode steps with a token tree or intermediate states, on any backend's pool step.

A backend whose pool step takes these itself (``Backend.pool_extras``: the ``"cpu"``
backend's fused step) runs them in one pass of that step. A backend whose capabilities leave
an extra out (``Capabilities.pool_extras``: the ``"pypto"`` decode kernel carries none) is
passed over with that reason, as any other. For the others, a tree step (``retrieve_parent_token``, EAGLE's token trees) and a step that keeps the state
after every token in the caller's buffer (``intermediate_states_buffer``; with
``disable_state_update`` the pool is only read) run as plain pool steps of the selected
backend over the buffer viewed as a pool of ``R * S_buf`` rows (or, without a buffer, a
float32 scratch buffer ``[N, S_buf, ...]`` in the pool's layout): the state after token j of
sequence n lives in row ``buffer_row[n] * S_buf + j``. A sequence's start state is copied
into the row of its first token, which the step reads and then overwrites (a sequence may
overwrite the row it reads); a chain (no tree) is then one step of the backend. A tree runs
one step per depth: every token of depth d is a one-token sequence that starts from its
parent's row. Afterwards, unless ``disable_state_update``, the states go to their pool rows
``ssm_state_indices[n, j]``, rounded to the pool's dtype.

The rules are :mod:`torch_gdr._pool`'s (:func:`~torch_gdr._pool.check_pool_args`,
:func:`~torch_gdr._pool.check_serving_extras`). The whole step is the op
``gdr::_pool_serve_step`` (it mutates the pool and the buffer; its fake gives ``o``), so
``torch.compile`` records one node and the checks, which read index values, run in its
eager body at run time.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from torch_gdr import _pool
from torch_gdr._gating import Gating
from torch_gdr.dispatch.run import run_pool_step, select_pool_step

Tensor = torch.Tensor


def run_pool_serve(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float], pool: Tensor,
                   ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor], *,
                   initial_state_indices: Optional[Tensor], retrieve_parent_token: Optional[Tensor],
                   intermediate_states_buffer: Optional[Tensor], intermediate_state_indices: Optional[Tensor],
                   disable_state_update: bool, cu_seqlens: Optional[Tensor], use_qk_l2norm_in_kernel: bool,
                   state_v_first: bool, validate: bool, backend: Optional[str], gating: Gating) -> Tensor:
    """The decode step with a tree and/or intermediate states (module docstring); the
    arguments of :func:`torch_gdr.fused_recurrent_gated_delta_rule`. Returns ``o`` in v's
    shape and dtype."""
    for name, t in (("retrieve_parent_token", retrieve_parent_token),
                    ("intermediate_state_indices", intermediate_state_indices)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected an integer torch.Tensor, got {type(t).__name__}")
    if intermediate_states_buffer is not None and not isinstance(intermediate_states_buffer, Tensor):
        raise TypeError(f"intermediate_states_buffer: expected a torch.Tensor, got "
                        f"{type(intermediate_states_buffer).__name__}")
    if not isinstance(disable_state_update, bool):
        raise TypeError(f"disable_state_update: expected a bool, got {type(disable_state_update).__name__}")
    _pool.check_pool_tensors(q, v, pool, state_v_first)
    extras = frozenset(name for name, used in (
        ("retrieve_parent_token", retrieve_parent_token is not None),
        ("intermediate_states_buffer", intermediate_states_buffer is not None),
        ("disable_state_update", disable_state_update),
        ("strided_pool", not _pool.rows_contiguous(pool)),
        ("fp8_pool", pool.dtype in _pool.FP8_DTYPES)) if used)
    selection = select_pool_step(q, v, ssm_state_indices, backend, extras)
    chosen = selection.backend
    if chosen.pool_extras:  # one pass of its own step
        serving = dict(retrieve_parent_token=retrieve_parent_token, intermediate_states_buffer=intermediate_states_buffer,
                       intermediate_state_indices=intermediate_state_indices, disable_state_update=disable_state_update)
        return run_pool_step(q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens,
                             cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             state_v_first=state_v_first, validate=validate, backend=backend, gating=gating,
                             initial_state_indices=initial_state_indices, serving=serving, selection=selection)
    return _serve_op(q, k, v, g, beta, pool, ssm_state_indices, num_accepted_tokens, initial_state_indices,
                     retrieve_parent_token, intermediate_states_buffer, intermediate_state_indices,
                     disable_state_update, cu_seqlens, None if scale is None else float(scale),
                     bool(use_qk_l2norm_in_kernel), bool(state_v_first), bool(validate), chosen.name, *gating)


def _serve_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor, ssm_state_indices: Tensor,
                num_accepted_tokens: Optional[Tensor], initial_state_indices: Optional[Tensor],
                retrieve_parent_token: Optional[Tensor], intermediate_states_buffer: Optional[Tensor],
                intermediate_state_indices: Optional[Tensor], disable_state_update: bool,
                cu_seqlens: Optional[Tensor], scale: Optional[float], use_qk_l2norm_in_kernel: bool,
                state_v_first: bool, validate: bool, backend: Optional[str], use_gate_in_kernel: bool = False,
                A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False) -> Tensor:
    """The op's eager body: the checks, then the backend's steps over the buffer."""
    gating = Gating(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    plan = _pool.check_pool_args(q, k, v, g, beta, scale, pool, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
                                 ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                                 start_indices=initial_state_indices, in_place=not disable_state_update,
                                 validate=True)
    serve = _pool.check_serving_extras(plan, pool, retrieve_parent_token, intermediate_states_buffer,
                                       intermediate_state_indices, disable_state_update)
    device, width = pool.device, serve.buffer_width
    buffer = intermediate_states_buffer
    if buffer is None:  # scratch rows for the states after each token, float32, this thread's
        buffer = _workspace("rows", (plan.num_seqs, width, *pool.shape[1:]), device)
    work = buffer.view(-1, *pool.shape[1:])  # a pool of R * S_buf rows in the pool's layout
    lens = plan.seq_lens
    start_rows = plan.start_rows.tolist()

    def slot(n: int, j: int) -> int:
        return serve.buffer_rows[n] * width + j

    def rows(values: list) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    step = dict(cu_seqlens=None, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=state_v_first,
                validate=False, backend=backend, gating=gating)
    if serve.parents is None:  # a chain: one step of the backend over the buffer's rows
        first = [slot(n, 0) if lens[n] > 0 else -1 for n in range(plan.num_seqs)]
        _copy_rows_in(work, pool, [(first[n], start_rows[n]) for n in range(plan.num_seqs) if first[n] >= 0])
        table = [[slot(n, j) if j < lens[n] else -1 for j in range(max(max(lens, default=0), 1))]
                 for n in range(plan.num_seqs)]
        step["cu_seqlens"] = cu_seqlens
        o = run_pool_step(q, k, v, g, beta, scale, work, rows(table), None, initial_state_indices=rows(first), **step)
    else:
        o = _tree_steps(q, k, v, g, beta, scale, work, pool, plan, serve, start_rows, slot, rows, step)
    if not disable_state_update:
        table = plan.indices.tolist()
        _copy_rows_out(pool, work, [(table[n][j], slot(n, j)) for n in range(plan.num_seqs) for j in range(lens[n])
                                    if table[n][j] >= 0])
    return o


_LOCAL = threading.local()


def _workspace(name: str, shape: tuple, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """A tensor of ``shape`` and ``dtype``, reused by this thread's later calls (a large fresh
    allocation costs a page fault per page on first touch). Per thread: no locking, no
    sharing between concurrent calls."""
    spaces = _LOCAL.__dict__.setdefault("spaces", {})
    numel = 1
    for size in shape:
        numel *= int(size)
    held = spaces.get((name, device, dtype))
    if held is None or held.numel() < numel:
        held = torch.empty(numel, dtype=dtype, device=device)
        spaces[name, device, dtype] = held
    return held[:numel].view(shape)


def _copy_row(dst: Tensor, src: Tensor, limit: Optional[float] = None) -> None:
    """``dst[...] = src`` for one pool row ``[HV, ...]``, head by head: each piece below
    torch's parallel grain, so the copies run in the calling thread (a parallel region per
    row costs a thread wake-up, tens of milliseconds on a loaded machine). ``limit``: clamp
    to ``[-limit, limit]`` first (an fp8 store), through a float32 workspace."""
    scratch = None if limit is None else _workspace("head", tuple(src.shape[1:]), src.device)
    for head in range(src.shape[0]):
        if scratch is None:
            dst[head].copy_(src[head])
        else:
            torch.clamp(src[head], -limit, limit, out=scratch)
            dst[head].copy_(scratch)


def _copy_rows_in(work: Tensor, pool: Tensor, pairs: list) -> None:
    """``work[slot] = pool[row]`` (zeros for row -1) for ``(slot, row)`` in ``pairs`` (no
    allocation; any strides and dtypes)."""
    for slot, row in pairs:
        if row < 0:
            work[slot].zero_()
        else:
            _copy_row(work[slot], pool[row])


def _copy_rows_out(pool: Tensor, work: Tensor, pairs: list) -> None:
    """``pool[row] = work[slot]`` for ``(row, slot)`` in ``pairs``, rounded to the pool's dtype
    as a store does (:func:`torch_gdr._pool.store_cast`: fp8 saturating)."""
    # torch's cast to float8_e4m3fn saturates by itself (it has no inf); to e5m2 it overflows to inf
    limit = torch.finfo(pool.dtype).max if pool.dtype == torch.float8_e5m2 else None
    for row, slot in pairs:
        _copy_row(pool[row], work[slot], limit)


def _tree_steps(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float], work: Tensor,
                pool: Tensor, plan: _pool.PoolPlan, serve: _pool.ServePlan, start_rows: list, slot, rows,
                step: dict) -> Tensor:
    """One backend step per depth of the trees: the tokens of depth d, each a one-token
    sequence from its parent's row (the start state copied into the token's own row for
    children of -1). Returns ``o`` in v's shape and dtype."""
    depth: dict[tuple[int, int], int] = {}
    levels: list[list[tuple[int, int]]] = []
    for n in range(plan.num_seqs):
        for j in range(plan.seq_lens[n]):
            parent = serve.parents[n][j]
            d = 0 if parent < 0 else depth[n, parent] + 1
            depth[n, j] = d
            while len(levels) <= d:
                levels.append([])
            levels[d].append((n, j))
    flat = [x.reshape(-1, *x.shape[(1 if plan.token_major else 2):]) for x in (q, k, v, g, beta)]
    o = torch.empty_like(flat[2])
    roots = [(n, j) for n, j in levels[0]] if levels else []
    _copy_rows_in(work, pool, [(slot(n, j), start_rows[n]) for n, j in roots])
    for level in levels:
        tokens = rows([plan.bos[n] + j for n, j in level])
        pieces = [x.index_select(0, tokens).unsqueeze(1) for x in flat]  # [M, 1, ...]
        write = rows([slot(n, j) for n, j in level])
        read = rows([slot(n, serve.parents[n][j]) if serve.parents[n][j] >= 0 else slot(n, j) for n, j in level])
        o_level = run_pool_step(*pieces, scale, work, write, None, initial_state_indices=read, **step)
        o.index_copy_(0, tokens, o_level[:, 0])
    return o.reshape(v.shape)


_SERVE_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) pool, Tensor ssm_state_indices, "
                 "Tensor? num_accepted_tokens, Tensor? initial_state_indices, Tensor? retrieve_parent_token, "
                 "Tensor(b!)? intermediate_states_buffer, Tensor? intermediate_state_indices, "
                 "bool disable_state_update, Tensor? cu_seqlens, float? scale, bool use_qk_l2norm_in_kernel, "
                 "bool state_v_first, bool validate, str? backend, bool use_gate_in_kernel=False, "
                 "Tensor? A_log=None, Tensor? dt_bias=None, bool use_beta_sigmoid_in_kernel=False, "
                 "bool allow_neg_eigval=False) -> Tensor")

_serve_op = torch.library.custom_op("gdr::_pool_serve_step", _serve_impl,
                                    mutates_args=("pool", "intermediate_states_buffer"), schema=_SERVE_SCHEMA)


@_serve_op.register_fake
def _serve_fake(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor, *args, **kwargs) -> Tensor:
    return torch.empty_like(v)
