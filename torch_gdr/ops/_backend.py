"""What a backend is: declared capabilities, the reasons it cannot serve a call, its ops.

Every backend folder under :mod:`torch_gdr.ops` (``torch``, ``cpu``, ``recurrent``,
``pypto``, ``fla``) exposes one :class:`Backend` object as ``BACKEND`` in its
``backend.py``. :mod:`torch_gdr.dispatch` keeps them in one registry and asks each, through
:meth:`Backend.unsupported_reasons`, whether it can serve a call described by a
:class:`CallSpec` (shapes, dtypes and devices only: no tensor data is read, so the question
is safe while ``torch.compile`` traces).

Entry points a backend may serve:

============== ======================================================================
``"chunk"``    the chunked call (``chunk_gated_delta_rule``, the public op, the local
               call under context parallelism, the layer's prefill)
``"step"``     the token-by-token call (``fused_recurrent_gated_delta_rule``, the
               layer's decode step)
``"checkpoints"`` the chunked call with ``checkpoint_every`` (serving)
``"pool_step"`` the step over a state pool, in place (``ssm_state_indices``; serving)
============== ======================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from torch_gdr._fallback import BackendError, FallbackWarning

Tensor = torch.Tensor

ENTRIES: tuple[str, ...] = ("chunk", "step", "checkpoints", "pool_step")


class Reason(NamedTuple):
    """Why a backend cannot serve a call: its words (``text``) and its ``kind``.

    - ``"unsupported"``: the backend does not take such calls (float64 on ``"cpu"``). A
      default falls back silently (with a warning where the backend says
      ``warns_when_unsupported``).
    - ``"missing"``: a backend this machine should have is missing or broken (kernels not
      built, pypto absent on an NPU, a broken fla install). A default falls back with one
      warning per reason; strict mode raises.
    - ``"absent"``: an optional extra that is simply not installed (fla-core without the
      ``[gpu]`` extra). A default falls back silently.

    A named tuple, not a ``str`` subclass: selection builds reasons while ``torch.compile``
    traces, and Dynamo traces a named tuple's construction (not ``str.__new__`` of a
    subclass). :func:`reason_text` joins reasons where words are needed.
    """

    text: str
    kind: str = "unsupported"


#: The kinds a :class:`Reason` may have.
REASON_KINDS: tuple[str, ...] = ("unsupported", "missing", "absent")


def reason_text(reasons: Sequence[Reason]) -> str:
    """The words of ``reasons``, joined by ``"; "`` (empty for none)."""
    return "; ".join(r.text for r in reasons)


class OpArgs(NamedTuple):
    """The arguments of the public op by name: the twelve a backend's forward op takes before
    ``save_chunk_states`` and ``strict``, then fla's activation arguments (after them in
    the forward op, :meth:`forward_args`)."""

    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    scale: Optional[float]
    initial_state: Optional[Tensor]
    output_final_state: bool
    use_qk_l2norm_in_kernel: bool
    cu_seqlens: Optional[Tensor]
    chunk_size: int
    state_v_first: bool
    use_gate_in_kernel: bool = False
    A_log: Optional[Tensor] = None
    dt_bias: Optional[Tensor] = None
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False

    def forward_args(self, save_chunk_states: bool, strict: bool) -> tuple:
        """The positional arguments of a backend's forward op for this call."""
        return (*self[:12], save_chunk_states, strict, *self[12:])


class CallSpec(NamedTuple):
    """A checked call as backends are asked about it: entry point, device, dtypes, sizes.

    Attributes:
        entry: one of :data:`ENTRIES`.
        device: the inputs' device.
        qk_dtype, v_dtype: dtypes of q (and k) and of v.
        head_k_dim, head_v_dim: K and V.
        chunk_size: the caller's chunk size (the step entry passes the smallest, unused).
        needs_grad: autograd records the call (an input requires grad, grad mode on).
        num_tokens: B * T, the tokens of the call.
        tokens_per_sequence: the pool step's S (``ssm_state_indices [N, S]``: the most tokens
            one sequence verifies in the step); 1 for every other entry.
        pool_extras: the pool step's serving extras the call uses (keys of
            :data:`POOL_EXTRAS`); empty for every other entry.
    """

    entry: str
    device: torch.device
    qk_dtype: torch.dtype
    v_dtype: torch.dtype
    head_k_dim: int
    head_v_dim: int
    chunk_size: int
    needs_grad: bool
    num_tokens: int
    tokens_per_sequence: int = 1
    pool_extras: frozenset[str] = frozenset()

    @classmethod
    def of(cls, entry: str, q: Tensor, v: Tensor, chunk_size: int, needs_grad: bool) -> "CallSpec":
        """The spec of a checked call (q ``[B, T, H, K]`` or ``[T, H, K]``, v likewise)."""
        num_tokens = q.shape[0] * q.shape[1] if q.dim() == 4 else q.shape[0]
        return cls(entry, q.device, q.dtype, v.dtype, q.shape[-1], v.shape[-1], int(chunk_size), bool(needs_grad),
                   int(num_tokens))


#: The serving extras of a decode step over a pool (issue 36), as a backend's pool step may
#: carry them in its kernel or not: name -> the words of a reason.
POOL_EXTRAS: dict[str, str] = {
    "retrieve_parent_token": "a token tree (retrieve_parent_token)",
    "intermediate_states_buffer": "intermediate states (intermediate_states_buffer)",
    "disable_state_update": "a step that leaves the pool unwritten (disable_state_update)",
    "strided_pool": "a pool whose rows are not contiguous",
    "fp8_pool": "an fp8 pool",
}


@dataclass(frozen=True)
class Capabilities:
    """What a backend serves; :meth:`Backend.unsupported_reasons` checks a call against it.

    Attributes:
        entries: the entry points it serves (:data:`ENTRIES`).
        device_types: device types it runs on (``torch.device.type``); None: any.
        dtypes: input dtypes of q, k and v it takes.
        same_dtype: q/k and v must share one dtype.
        head_dims: the K and V it takes; None: any.
        chunk_sizes: the chunk sizes of the chunked call it takes; None: any the call takes.
        training: the chunked call has a backward (gradients).
        step_training: the step has a backward.
        pool_extras: the serving extras (:data:`POOL_EXTRAS`) its pool step serves; None: all
            of them (in its own kernel, or through dispatch's packed float32 rows).
    """

    entries: frozenset[str]
    device_types: Optional[tuple[str, ...]] = None
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    same_dtype: bool = False
    head_dims: Optional[tuple[int, ...]] = None
    chunk_sizes: Optional[tuple[int, ...]] = None
    training: bool = True
    step_training: bool = True
    pool_extras: Optional[frozenset[str]] = None


#: ``step(call) -> (o, final_state)``: the token-by-token call on a checked call in the
#: canonical layout (:class:`torch_gdr._layout.GdrCall`), key-first final state.
StepFn = Callable[[Any], tuple[Tensor, Tensor]]


@dataclass
class Backend:
    """One backend: its name, capabilities, ops and the errors of its fallback policy.

    Attributes:
        name: the ``backend=`` name.
        capabilities: what it declares it serves.
        forward_op: ``gdr::_{name}_fwd`` (the chunked forward, :mod:`torch_gdr.ops._define`).
        backward_op: its backward op.
        keeps_chunk_states: its forward op returns states its backward reads.
        step: the token-by-token call, or None (an op, or plain differentiable torch).
        checkpoints: ``checkpoints(args, checkpoint_every) -> (o, final_state, checkpoints,
            offsets)`` for the checkpoints entry, or None.
        pool_step: the step over a state pool in place (the arguments of
            :func:`torch_gdr.ops.torch.pool.pool_recurrent_step`; returns ``o``), or None.
        prepared_pool_step: ``prepared_pool_step(q, k, v, g, beta, scale, pool, ssm_state_indices,
            num_accepted_tokens, *, use_qk_l2norm_in_kernel, state_v_first, gating,
            initial_state_indices, cu_seqlens)``: for a plain in-place decode (no serving
            extras) whose signature its :attr:`pool_step` has checked and run before, a function
            ``(q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens,
            initial_state_indices, A_log, dt_bias, cu_seqlens) -> o or None`` running later
            calls of that signature with only their index and offset values checked (None: a
            value might break a rule; the caller runs every check); or None (no such call run
            yet, or no such path).
        step_inplace: ``step_inplace(call, state) -> o``: the step writing its final state
            into ``state``, the caller's ``initial_state`` (public layout, checked by
            :mod:`torch_gdr._inplace`), with no new state tensor; None: dispatch runs
            :attr:`step` and copies its result in (:func:`torch_gdr.dispatch.run.run_step_inplace`).
        pool_extras: its ``pool_step`` also takes the serving extras as keywords
            (``retrieve_parent_token``, ``intermediate_states_buffer``,
            ``intermediate_state_indices``, ``disable_state_update``) and pools of any strides
            and of every pool dtype (fp8 included), in one pass; for other backends dispatch
            runs those calls over their ``pool_step`` on packed float32 rows
            (:mod:`torch_gdr.dispatch.pool_serve`).
        may_fail: its kernels can fail at run time (a build or a refusal inside the call),
            which the policy treats as a fallback reason.
        warns_when_unsupported: as the default of its device, it warns (once per reason)
            also for calls it does not take, not only when it is missing: on an accelerator
            the pure-torch path is a cliff worth a word.
        error: what a named backend raises when it cannot serve a call.
        warning: what a default backend warns with when it falls back.
        description: one line for ``python -m torch_gdr`` and error messages.
        extra_reasons: ``extra_reasons(call) -> list[Reason]``, the backend's own checks beyond
            its capabilities (an extension not built, pypto not installed...).
        in_kernel_gating: the entries among ``"step"`` and ``"pool_step"`` that take raw g
            and beta with fla's activation arguments (``pool_step`` as the keyword
            ``gating``, ``step`` as a :class:`~torch_gdr._layout.GdrCall`'s fields) and apply
            them in its kernels; for every other entry dispatch activates g and beta before
            it (:mod:`torch_gdr._gating`). The chunked ops say it themselves
            (:mod:`torch_gdr.ops._define`).
    """

    name: str
    capabilities: Capabilities
    forward_op: Any = None
    backward_op: Any = None
    keeps_chunk_states: bool = False
    step: Optional[StepFn] = None
    checkpoints: Optional[Callable[..., tuple]] = None
    pool_step: Optional[Callable[..., Tensor]] = None
    prepared_pool_step: Optional[Callable[..., Optional[Callable[..., Optional[Tensor]]]]] = None
    step_inplace: Optional[Callable[[Any, Tensor], Tensor]] = None
    pool_extras: bool = False
    may_fail: bool = False
    warns_when_unsupported: bool = False
    error: type[BackendError] = BackendError
    warning: type[FallbackWarning] = FallbackWarning
    description: str = ""
    extra_reasons: Optional[Callable[[CallSpec], list[Reason]]] = field(default=None, repr=False)
    in_kernel_gating: frozenset[str] = frozenset()

    def unsupported_reasons(self, call: CallSpec, needs_grad: Optional[bool] = None) -> list[Reason]:
        """Every reason this backend cannot serve ``call``; empty when it can.

        ``needs_grad`` overrides ``call.needs_grad`` when given."""
        caps = self.capabilities
        needs_grad = call.needs_grad if needs_grad is None else needs_grad
        reasons: list[Reason] = []
        if call.entry not in caps.entries:
            what = {"chunk": "the chunked call", "step": "the token-by-token step",
                    "checkpoints": "checkpoints (checkpoint_every)",
                    "pool_step": "step over a state pool (ssm_state_indices)"}[call.entry]
            reasons.append(Reason(f"it has no {what}"))
        if caps.device_types is not None and call.device.type not in caps.device_types:
            reasons.append(Reason(f"it runs on {' or '.join(caps.device_types)} tensors, not on "
                                  f"{call.device.type!r} tensors"))
        for name, dtype in (("q/k", call.qk_dtype), ("v", call.v_dtype)):
            if dtype not in caps.dtypes:
                reasons.append(Reason(f"it takes {_names(caps.dtypes)} inputs, got {name} in {dtype}"))
        if caps.same_dtype and call.qk_dtype != call.v_dtype:
            reasons.append(Reason(f"it takes one dtype for q, k and v, got q/k in {call.qk_dtype} and v in "
                                  f"{call.v_dtype}"))
        if caps.head_dims is not None and (call.head_k_dim not in caps.head_dims
                                           or call.head_v_dim not in caps.head_dims):
            reasons.append(Reason(f"it has head dims K, V in {list(caps.head_dims)}, got K = {call.head_k_dim}, "
                                  f"V = {call.head_v_dim}"))
        if call.entry in ("chunk", "checkpoints") and caps.chunk_sizes is not None and call.chunk_size not in caps.chunk_sizes:
            reasons.append(Reason(f"it has chunk sizes {list(caps.chunk_sizes)}, got chunk_size = {call.chunk_size}"))
        if call.entry == "pool_step" and caps.pool_extras is not None:
            for extra in sorted(call.pool_extras - caps.pool_extras):
                reasons.append(Reason(f"its pool step does not carry {POOL_EXTRAS[extra]}"))
        if needs_grad:
            if call.entry == "chunk" and not caps.training:
                reasons.append(Reason("it has no backward (an input requires grad)"))
            if call.entry == "step" and not caps.step_training:
                reasons.append(Reason("its step has no backward (an input requires grad)"))
        if self.extra_reasons is not None:
            for reason in self.extra_reasons(call):
                if reason.kind not in REASON_KINDS:
                    raise ValueError(f"{self.name}: a reason's kind: expected one of {list(REASON_KINDS)}, got "
                                     f"{reason.kind!r}")
                reasons.append(reason)
        return reasons

    def serves(self, call: CallSpec) -> bool:
        """Whether :meth:`unsupported_reasons` is empty for ``call``."""
        return not self.unsupported_reasons(call)


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return "/".join(str(d).replace("torch.", "") for d in dtypes)
