"""The ``"torch"`` backend: the chunked algorithm in pure torch, on any device.

One file per stage, as fla lays out its ops: :mod:`.chunk` (the forward) and
:mod:`.chunk_backward` (its hand-written backward) on the segment primitives of
:mod:`.segment`, :mod:`.chunk_layout`, :mod:`.chunk_states`, :mod:`.triangular` and
:mod:`.nonfinite`; :mod:`.fused_recurrent` (the token-by-token step); :mod:`.checkpoints`
(states every N tokens for serving). :mod:`.op` makes them ``torch.library`` ops and
:mod:`.backend` declares what the backend serves.
"""
