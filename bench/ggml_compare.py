"""Our fused CPU kernels against ggml's CPU ``GATED_DELTA_NET`` op (what llama.cpp runs for
Qwen3-Next / Qwen3.5), same run, same inputs, float32, alternated rounds (issue 38).

ggml is built from its own sources outside this repository (never into the package), e.g.::

    git clone https://github.com/ggml-org/ggml /work/peers/ggml   # or a local mirror
    cmake -S /work/peers/ggml -B /work/peers/ggml/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF
    cmake --build /work/peers/ggml/build
    PYTHONPATH=$PWD python bench/ggml_compare.py --ggml-dir /work/peers/ggml

The driver ``bench/ggml_gdn.c`` is compiled into a temporary directory against it. What is
compared:

- prefill, B = 1, T = 4096, K = V = 128, H4/HV4 and H16/HV32, a random initial state: our
  ``chunk_gated_delta_rule(backend="cpu")`` (o and the final state) against the op;
- decode, one token, B = 1 / 8 / 64, H16/HV32: our pool step over a 512-slot float32 pool at
  random rows, in place (the CPU backend's step, and the exported
  ``fused_recurrent_gated_delta_rule(..., ssm_state_indices=...)`` with int32 rows, batched
  ``[B, 1, ...]`` and packed ``[1, B, ...]`` with ``cu_seqlens`` as vLLM's decode calls it),
  and our per-sequence step (contiguous states, in place), against the
  op reading B contiguous states from a random place of a 512-slot value-first pool (its
  output, o and the new states, in one buffer of its own), and against the op followed by
  a copy of its new states over the states it read (``ggml_cpy`` in the same graph: the
  write-back llama.cpp's graph adds after the op; llama.cpp also gathers the states into a
  buffer of their own first, which is not counted here).

ggml's value head j reads q/k head ``j % H``, ours ``j // (HV / H)``: ggml gets our value
heads (v, g, beta, the state) permuted so that both compute the same thing; its state is
value-first (``[V, K]`` per head). q and k are unit-norm (neither side normalises), scale
``K ** -0.5`` (ggml's). Agreement: the largest difference over the largest magnitude, o and
the final state, checked once per shape before timing.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import torch_gdr
from torch_gdr.ops.cpu import kernels
from torch_gdr.ops.cpu.pool import pool_recurrent_fwd

try:
    from bench.half_bench import alternate, cpu_name, ratio
except ImportError:  # run as a script from bench/
    from half_bench import alternate, cpu_name, ratio  # type: ignore[no-redef]

DIM, SLOTS = 128, 512
AGREEMENT = 5e-7


def ggml_build_flags(ggml_dir: Path) -> str:
    """How the ggml under ``ggml_dir`` was configured (its CMakeCache.txt): ``GGML_NATIVE=ON``
    (``-march=native``), or the instruction sets switched on."""
    cache = ggml_dir / "build" / "CMakeCache.txt"
    if not cache.is_file():
        return "build flags unknown (no build/CMakeCache.txt)"
    flags = {}
    for line in cache.read_text().splitlines():
        name, _, value = line.partition("=")
        name = name.split(":")[0]
        if name.startswith("GGML_") and value in ("ON", "OFF"):
            flags[name] = value
    if flags.get("GGML_NATIVE") == "ON":
        return "GGML_NATIVE=ON (-march=native)"
    isa = ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_AVX_VNNI", "GGML_AVX512", "GGML_AVX512_BF16",
           "GGML_AMX_BF16")
    return "GGML_NATIVE=OFF, " + (" ".join(name[5:] for name in isa if flags.get(name) == "ON") or "no SIMD flags")


def build_driver(ggml_dir: Path, out_dir: Path) -> ctypes.CDLL:
    """Compile bench/ggml_gdn.c against the ggml build under ``ggml_dir`` and load it."""
    libs = sorted({p.parent for p in (ggml_dir / "build").rglob("libggml*.so")})
    if not libs:
        raise SystemExit(f"--ggml-dir: no libggml*.so under {ggml_dir / 'build'}; build ggml first")
    lib = out_dir / "libgdn_driver.so"
    cmd = ["gcc", "-O2", "-shared", "-fPIC", str(Path(__file__).with_name("ggml_gdn.c")), "-o", str(lib),
           f"-I{ggml_dir / 'include'}", *(f"-L{d}" for d in libs), *(f"-Wl,-rpath,{d}" for d in libs),
           "-lggml", "-lggml-base", "-lggml-cpu"]
    subprocess.run(cmd, check=True)
    driver = ctypes.CDLL(str(lib))
    ptr = ctypes.c_void_p
    driver.gdn_create.restype = ptr
    driver.gdn_create.argtypes = [ctypes.c_int] * 6 + [ptr] * 7 + [ctypes.c_int]
    driver.gdn_compute.argtypes = [ptr]
    driver.gdn_set_state.argtypes = [ptr, ptr]
    driver.gdn_destroy.argtypes = [ptr]
    driver.gdn_out_floats.restype = ctypes.c_long
    driver.gdn_out_floats.argtypes = [ctypes.c_int] * 4
    return driver


def ggml_heads(heads: int, v_heads: int) -> torch.Tensor:
    """perm with ggml value head ``perm[j]`` = our value head j: both read q/k head j // G."""
    group = v_heads // heads
    perm = torch.empty(v_heads, dtype=torch.long)
    for j in range(v_heads):
        perm[j] = (j % group) * heads + j // group  # (j % G) * H + j // G: % H gives j // G
    return perm


class GgmlOp:
    """One ggml graph over fixed buffers: q, k as ours; v, g, beta, the state with ggml's head
    order; the output buffer of the op."""

    def __init__(self, driver: ctypes.CDLL, threads: int, q, k, v, g, beta, state_vf: torch.Tensor,
                 write_back: bool = False):
        self.driver = driver
        batch, seq_len, heads, dim = q.shape
        v_heads = v.shape[2]
        self.perm = ggml_heads(heads, v_heads)
        inv = torch.argsort(self.perm)  # ggml head j' holds our head inv[j']
        self.q, self.k = q.contiguous(), k.contiguous()
        self.v = v[:, :, inv].contiguous()
        self.g, self.beta = g[:, :, inv].contiguous(), beta[:, :, inv].contiguous()
        self.state = state_vf  # [B, HV, V, K] in ggml's head order (the caller's)
        self.out = torch.empty(driver.gdn_out_floats(dim, v_heads, seq_len, batch))
        self.shape = (batch, seq_len, v_heads, dim)
        self.handle = driver.gdn_create(dim, heads, v_heads, seq_len, batch, threads,
                                        *(t.data_ptr() for t in (self.q, self.k, self.v, self.g, self.beta,
                                                                 self.state, self.out)), int(write_back))

    def set_state(self, state_vf: torch.Tensor) -> None:
        self.state = state_vf
        self.driver.gdn_set_state(self.handle, state_vf.data_ptr())

    def __call__(self) -> None:
        if self.driver.gdn_compute(self.handle) != 0:
            raise RuntimeError("ggml_graph_compute failed")

    def results(self) -> tuple[torch.Tensor, torch.Tensor]:
        """o ``[B, T, HV, V]`` and the final state key-first ``[B, HV, K, V]``, in our head order."""
        batch, seq_len, v_heads, dim = self.shape
        n_o = batch * seq_len * v_heads * dim
        o = self.out[:n_o].view(batch, seq_len, v_heads, dim)[:, :, self.perm]
        s = self.out[n_o:n_o + batch * v_heads * dim * dim].view(batch, v_heads, dim, dim)[:, self.perm]
        return o, s.transpose(-1, -2)

    def close(self) -> None:
        self.driver.gdn_destroy(self.handle)


def rel(ref: torch.Tensor, out: torch.Tensor) -> float:
    return ((ref.double() - out.double()).abs().max() / ref.double().abs().max()).item()


def inputs(batch: int, seq_len: int, heads: int, v_heads: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return dict(q=F.normalize(torch.randn(batch, seq_len, heads, DIM, generator=gen), dim=-1),
                k=F.normalize(torch.randn(batch, seq_len, heads, DIM, generator=gen), dim=-1),
                v=torch.randn(batch, seq_len, v_heads, DIM, generator=gen),
                g=F.logsigmoid(torch.randn(batch, seq_len, v_heads, generator=gen)),
                beta=torch.sigmoid(torch.randn(batch, seq_len, v_heads, generator=gen)))


def prefill(driver: ctypes.CDLL, threads: int, rounds: int, seq_len: int, heads: int, v_heads: int) -> None:
    x = inputs(1, seq_len, heads, v_heads, seed=heads)
    h0 = torch.randn(1, v_heads, DIM, DIM, generator=torch.Generator().manual_seed(9)) * 0.05
    op = GgmlOp(driver, threads, *x.values(), h0[:, torch.argsort(ggml_heads(heads, v_heads))].transpose(-1, -2)
                .contiguous())

    def ours():
        with torch.no_grad():
            return torch_gdr.chunk_gated_delta_rule(*x.values(), None, h0, True, backend="cpu")

    o, s = ours()
    op()
    go, gs = op.results()
    agree = max(rel(go, o), rel(gs, s))
    times = alternate({"ours": ours, "ggml": op}, rounds, warmup=1)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    print(f"prefill T={seq_len} H{heads}/HV{v_heads}: ours {med['ours']:.1f} ms, ggml {med['ggml']:.1f} ms; "
          f"ggml/ours {ratio(times, 'ggml', 'ours'):.2f}x (target >= 2.5); agreement {agree:.2e} "
          f"(bound {AGREEMENT:g}: {'met' if agree <= AGREEMENT else 'MISSED'})")
    op.close()


def decode(driver: ctypes.CDLL, threads: int, rounds: int, batch: int, pool: torch.Tensor,
           pool_vf: torch.Tensor, heads: int = 16, v_heads: int = 32) -> None:
    x = inputs(batch, 1, heads, v_heads, seed=100 + batch)
    gen = torch.Generator().manual_seed(batch)
    inv = torch.argsort(ggml_heads(heads, v_heads))
    # agreement: both from the states now in rows 0..B-1 (earlier timings updated our pool, not ggml's)
    op = GgmlOp(driver, threads, *x.values(), pool[:batch][:, inv].transpose(-1, -2).contiguous())
    with torch.no_grad():
        states = pool[:batch].clone()
        o_ref, s_ref = kernels.recurrent_fwd(*x.values(), None, states, False, None)
        rows = torch.arange(batch)
        saved = pool[:batch].clone()
        o_pool = pool_recurrent_fwd(*x.values(), None, pool, rows)
        s_pool = pool[:batch].clone()
        pool[:batch] = saved
    op()
    go, gs = op.results()
    agree = max(rel(go, o_ref), rel(gs, s_ref), rel(o_pool, o_ref), rel(s_pool, s_ref))
    # the op with the write-back: its new states must land, exactly, where it read them
    op_wb = GgmlOp(driver, threads, *x.values(), pool[:batch][:, inv].transpose(-1, -2).contiguous(), write_back=True)
    op_wb()
    written = op_wb.state[:, torch.argsort(inv)].transpose(-1, -2)  # our head order, key-first
    if not torch.equal(written, op_wb.results()[1]):
        raise SystemExit(f"decode B={batch}: ggml's write-back did not copy the op's new states")
    agree = max(agree, rel(written, s_ref))

    def pool_step():
        rows = torch.randperm(SLOTS, generator=gen)[:batch]
        with torch.no_grad():
            pool_recurrent_fwd(*x.values(), None, pool, rows)

    def public():  # the exported call as a serving engine makes it: int32 rows, in place
        rows = torch.randperm(SLOTS, generator=gen)[:batch].to(torch.int32)
        with torch.no_grad():
            torch_gdr.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta=x["beta"],
                                                       initial_state=pool, ssm_state_indices=rows, backend="cpu")

    packed = {name: t.transpose(0, 1) for name, t in x.items()}  # [1, B, ...] views, one token a sequence
    offsets = torch.arange(batch + 1, dtype=torch.int32)

    def public_varlen():  # the exported call as vLLM's decode makes it: packed tokens, cu_seqlens, int32 rows
        rows = torch.randperm(SLOTS, generator=gen)[:batch].to(torch.int32)
        with torch.no_grad():
            torch_gdr.fused_recurrent_gated_delta_rule(packed["q"], packed["k"], packed["v"], packed["g"],
                                                       beta=packed["beta"], initial_state=pool,
                                                       ssm_state_indices=rows, cu_seqlens=offsets,
                                                       inplace_final_state=True, backend="cpu")

    def per_sequence():
        start = int(torch.randint(0, SLOTS - batch + 1, (1,), generator=gen))
        with torch.no_grad():
            kernels.recurrent_fwd(*x.values(), None, pool[start:start + batch], False, None,
                                  out_state=pool[start:start + batch])

    def ggml():
        start = int(torch.randint(0, SLOTS - batch + 1, (1,), generator=gen))
        op.set_state(pool_vf[start:start + batch])
        op()

    def ggml_write_back():
        start = int(torch.randint(0, SLOTS - batch + 1, (1,), generator=gen))
        op_wb.set_state(pool_vf[start:start + batch])
        op_wb()

    # a round runs each variant `reps` times (one small step is too short to time alone)
    reps = max(1, 16 // batch)
    variants = {"public": public, "public_varlen": public_varlen, "pool_step": pool_step,
                "per_sequence": per_sequence, "ggml": ggml, "ggml_write_back": ggml_write_back}
    times = alternate({name: (lambda call=call: [call() for _ in range(reps)]) for name, call in variants.items()},
                      rounds, warmup=2)
    med = {n: statistics.median(t) * 1e6 / reps for n, t in times.items()}
    print(f"decode B={batch} H{heads}/HV{v_heads}: ours pool step {med['pool_step']:.0f} us (public call "
          f"{med['public']:.0f} us), ours per-sequence {med['per_sequence']:.0f} us, ggml {med['ggml']:.0f} us; "
          f"ggml/ours pool step {ratio(times, 'ggml', 'pool_step'):.2f}x, public call "
          f"{ratio(times, 'ggml', 'public'):.2f}x, vLLM's varlen call ({med['public_varlen']:.0f} us) "
          f"{ratio(times, 'ggml', 'public_varlen'):.2f}x, per-sequence {ratio(times, 'ggml', 'per_sequence'):.2f}x"
          f" (target B=1 >= 1.0); ggml with the write-back {med['ggml_write_back']:.0f} us: / ours pool step "
          f"{ratio(times, 'ggml_write_back', 'pool_step'):.2f}x, public call "
          f"{ratio(times, 'ggml_write_back', 'public'):.2f}x; agreement {agree:.2e}")
    op.close()
    op_wb.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ggml-dir", type=Path, default=Path("/work/peers/ggml"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--parts", nargs="+", default=["prefill", "decode"], choices=["prefill", "decode"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        driver = build_driver(args.ggml_dir, Path(tmp))
        print(cpu_name(), f"; ggml {args.ggml_dir} ({ggml_build_flags(args.ggml_dir)}), {args.threads} threads")
        if "prefill" in args.parts:
            for heads, v_heads in ((4, 4), (16, 32)):
                prefill(driver, args.threads, args.rounds, args.seq_len, heads, v_heads)
        if "decode" in args.parts:
            gen = torch.Generator().manual_seed(0)
            pool = torch.randn(SLOTS, 32, DIM, DIM, generator=gen) * 0.05
            inv = torch.argsort(ggml_heads(16, 32))
            pool_vf = pool[:, inv].transpose(-1, -2).contiguous()  # ggml's layout of the same states
            for batch in args.batches:
                decode(driver, args.threads, args.rounds, batch, pool, pool_vf)


if __name__ == "__main__":
    main()
