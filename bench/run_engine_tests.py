"""Run the serving engines' own GDN state-pool tests against torch_gdr, on the CPU.

    python bench/run_engine_tests.py [--peers DIR] [--engine vllm sglang flashinfer]
                                     [--backend cpu torch] [--long] [--timeout S] [--only TEXT]
                                     [-- pytest args...]

The engines' test files (vLLM, SGLang, FlashInfer; their code, not shipped here) are read
from ``DIR/<engine>/<commit>/<path in the repository>`` (default DIR: ``/work/peers``), the
commits recorded below in :data:`ENGINES`; nothing is downloaded. Each engine's files are
copied, unedited, into a temporary directory and run there by pytest with
``tests/engine_standins/<engine>`` first on the path (modules with the import names the
tests use, served by torch_gdr) and the plugin ``tests/engine_standins/cuda_on_cpu.py``
(the tests' CUDA tensors made on the CPU). ``TORCH_GDR_ENGINE_BACKEND`` picks the torch_gdr
backend the stand-ins call. Tests of the engines' own non-GDN code or kernel internals are
left out, each with its reason (printed); so are FlashInfer's test files that test only its
own kernels (:data:`FLASHINFER_NOT_RUN`, printed).

Long cases (the slow marks of this runner, each ``-k`` expression with its reason, printed):
a plain run leaves them out, so it stays within minutes per file; ``--long`` runs every case
(the full run: FlashInfer's state-pool families in full, its prefill grids in full) and lets
the tests that ask for free device memory see the host's available memory
(``TORCH_GDR_ENGINE_HOST_MEMORY=1``; without it the plugin reports none and they skip
themselves). Extra pytest arguments go after ``--`` (e.g. ``-- --durations=20``). Prints
passed/failed/skipped per engine, file and backend; exit status 1 when a test failed or
errored.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STANDINS = ROOT / "tests" / "engine_standins"
DEFAULT_PEERS = Path("/work/peers")


@dataclasses.dataclass(frozen=True)
class TestFile:
    """One test file of an engine: its path in the repository at ``commit``, the files it
    imports (``(commit, path)``, copied beside it), the tests left out and the long cases
    (run only with ``--long``), both as pytest ``-k`` expressions each with its reason, and
    pytest options of its own."""

    path: str
    commit: str
    imports: tuple[tuple[str, str], ...] = ()
    left_out: tuple[tuple[str, str], ...] = ()
    long: tuple[tuple[str, str], ...] = ()
    options: tuple[str, ...] = ()


_FLASHINFER = "fb28d7242b3506a2348265962041acc1fb56cca4"
#: beside each FlashInfer file: the package marker, the directory's conftest (its input
#: factory fixture) and the reference module the tests import relatively
_FLASHINFER_IMPORTS = tuple((_FLASHINFER, p) for p in ("tests/__init__.py", "tests/gdn/conftest.py",
                                                        "tests/gdn/reference_delta_rule.py"))
#: test_prefill_delta_rule.py (3612 cases): its three grids of plain prefill (initial and
#: final states passed whole, no pool), 3456 cases, run in full only with --long; a plain run
#: takes their cases with the second sequence-length set and alpha and beta on (224), and
#: every other test (the checkpoint, zero-length and state-dtype families: 156)
_FLASHINFER_PREFILL_LONG = (
    ("(kernel_basic or kernel_nonfull or chunked_prefill) and not (seq_lens1 and True-True)",
     "the plain-prefill grids' other 3232 cases (no state pool; ~25 min per backend on 2 cores)"),)
#: test_decode_delta_rule.py (418 cases): the state-pool families in full (the bf16-state
#: kernel families through the ``flashinfer.gdn_kernels`` stand-ins); what is left out and
#: what is long, each with its reason
_FLASHINFER_DECODE_LEFT_OUT = (
    ("test_verify_kernel_mtp_reuses_compile_across_cache_modes",
     "counts FlashInfer's CuTe compilations (imports cutlass): its kernel cache, not a state-pool contract"),
    ("test_decode_kernel_bf16_padding_indices",
     "its last assert wants FlashInfer's bf16 kernel's null-buffer side effect (a -1 row writes pool slot 0); "
     "torch_gdr never writes a -1 row (by contract); the output and state asserts before it pass"),
    ("test_gdn_decode_fp32_state_fla_scatter_vs_dense and 128-8",
     "needs ~19 GiB of host memory (three 4.5 GiB pools of 1152 slots at HV = 64 and a 4 GiB buffer), "
     "more than this 23 GiB machine shared with other sessions; sized for a GPU's memory"),
    ("test_gdn_decode_bf16_state_fla_scatter_vs_dense and 64-256-8",
     "needs ~18-19 GiB of host memory (three 4.5-5 GiB bf16 pools of 2304-2560 slots at HV = 64 and a 4 GiB "
     "buffer), as its fp32 twin at B = 128, T = 8; B = 256 at T = 2 and 4 run with --long"),
)
_FLASHINFER_DECODE_LONG = (
    ("test_decode_kernel_basic and 512", "B = 512 (1 GiB of state): 26-65 s each on 2 shared cores, most of it the "
                                         "test's own reference and assert_close"),
    ("test_mtp_fp32_state_with_cache_and_state_update and bfloat16-64", "B = 64, T up to 8: 12-43 s each"),
    ("test_gdn_decode_fp32_state_fla_scatter_vs_dense and (64- or 128-)",
     "B = 64 and 128 at HV = 64: 3-11 GiB of pools and buffers, 16-150 s each"),
    ("(bf16_state_wide_vec_mtp_kernel and bfloat16-256-) or (bf16_state and 64-256-)",
     "B = 256 at HV = 64 in the bf16-state families (wide-vec MTP, recovery per request, FLA scatter vs dense): "
     "0.5 GiB pools, up to 4 GiB buffers, 1-4 min each on 2 shared cores"),
    ("bf16_state_fla_scatter and 64-8",
     "B = 64, T = 8 of the bf16 FLA-scatter families (vs dense, state only, accepted steps): 15-26 s each"),
)
_FLASHINFER_NONCONTIGUOUS_LEFT_OUT = (
    ("test_decode_pretranspose_pool_int64_offset and 8191",
     "a 17.7 GB padded fp32 pool (8192 slots): more than this 23 GB machine shared with other sessions can spare; "
     "the same int64-offset path runs at slot 3972 (8.6 GB) with --long"),
    ("test_decode_pretranspose_pool_reuses_compile_across_outer_layouts",
     "counts FlashInfer's CuTe compilations (its cute.compile patched) and clears its kernel cache: a compile "
     "cache, not a state-pool contract; the same strided-pool outputs and states are asserted by "
     "test_decode_pretranspose_pool_noncontiguous_state"),
    ("test_decode_pretranspose_pool_cache_keeps_inner_strides_static",
     "the keys of FlashInfer's CuTe kernel cache (_get_compiled_decode_kernel): its compile cache"),
    ("test_decode_pretranspose_pool_rejects_misaligned_slot_stride",
     "the 128-bit-copy alignment assert of FlashInfer's CuTe kernel (run_pretranspose_decode); torch_gdr's "
     "steps take any slot stride"),
)
#: FlashInfer's tests/gdn files not run, with the reason
FLASHINFER_NOT_RUN = (
    ("tests/gdn/test_decode_ucache.py", "FlashInfer's WY ring-cache (ucache) CuTe kernels, loaded from its "
                                        "flashinfer/gdn_kernels/*.py sources by path: their internals"),
    ("tests/gdn/test_fused_decode.py", "FlashInfer's fused conv + GDN decode kernel registry for SM120 "
                                       "(flashinfer.gdn_kernels.experimental): dispatch, graph capture, PDL"),
    ("tests/gdn/test_prefill_cp_delta_rule.py", "the stages of FlashInfer's context-parallel prefill kernel "
                                                "(flashinfer.gdn_kernels.delta_rule_dsl); its public use_cp "
                                                "path runs in test_prefill_delta_rule.py and "
                                                "test_prefill_state_indices.py"),
)
_VLLM_CONV = "vLLM's causal-conv1d ops and its layer code (not the GDN kernels torch_gdr serves)"

#: engine -> its test files. Commits: the versions read from the public repositories
#: (vllm-project/vllm, sgl-project/sglang, flashinfer-ai/flashinfer).
ENGINES: dict[str, tuple[TestFile, ...]] = {
    "vllm": (
        TestFile("tests/kernels/test_fused_recurrent.py", "6b37c73ecc1db2d85a12c0fdca759950c5658317"),
        TestFile("tests/kernels/mamba/cpu/test_cpu_gdn_ops.py", "02265e89bfbfd71e7820e940a1e41fed871078d7",
                 left_out=(("causal_conv1d", _VLLM_CONV), ("spec_aware_nonspec", _VLLM_CONV),
                           ("batch_memcpy", "vLLM's triton-cpu memcpy utility"))),
    ),
    "sglang": (
        TestFile("test/srt/cpu/test_mamba.py", "6bfad8f187aa80f7c9a2a06f7861409c4e3a4ad2",
                 imports=(("13ed97385bbfd6d15a801ffbfed1c8286f46877d", "test/srt/cpu/utils.py"),)),
    ),
    "flashinfer": tuple(
        TestFile(f"tests/gdn/{name}", _FLASHINFER, imports=_FLASHINFER_IMPORTS, left_out=left_out, long=long,
                 options=("--import-mode=importlib",))  # FlashInfer's pytest.ini
        for name, left_out, long in (
            ("test_prefill_delta_rule.py", (), _FLASHINFER_PREFILL_LONG),
            ("test_prefill_state_indices.py", (), ()),
            ("test_decode_pretranspose_noncontiguous_pool.py", _FLASHINFER_NONCONTIGUOUS_LEFT_OUT, ()),
            ("test_decode_pretranspose_bf16_padded_pool.py", (), ()),
            ("test_decode_delta_rule.py", _FLASHINFER_DECODE_LEFT_OUT, _FLASHINFER_DECODE_LONG),
        )),
}


def _copy(peers: Path, engine: str, commit: str, path: str, dest_root: Path, flatten: bool) -> Path:
    source = peers / engine / commit / path
    if not source.is_file():
        raise FileNotFoundError(f"{source}: not found; fetch {engine}'s {path} at commit {commit} there")
    target = dest_root / (Path(path).name if flatten else path)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


def _counts(report: Path) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    if not report.is_file():
        return counts
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            counts["failed"] += 1
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def run_file(engine: str, spec: TestFile, backend: str, peers: Path, extra: list[str],
             timeout: float, long: bool = False) -> dict[str, object]:
    """Run one file on one backend (its long cases too with ``long``); returns its counts and
    wall time."""
    flatten = engine != "flashinfer"  # FlashInfer's files import each other as a package
    with tempfile.TemporaryDirectory(prefix=f"torch_gdr_{engine}_") as tmp:
        tmp_path = Path(tmp)
        target = _copy(peers, engine, spec.commit, spec.path, tmp_path, flatten)
        for commit, path in spec.imports:
            _copy(peers, engine, commit, path, tmp_path, flatten)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(STANDINS / engine), str(STANDINS), str(ROOT)]
                                            + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["TORCH_GDR_ENGINE_BACKEND"] = backend
        env.setdefault("OMP_NUM_THREADS", "1")
        if long:
            env["TORCH_GDR_ENGINE_HOST_MEMORY"] = "1"
        keep = [f"not ({expr})" for expr, _ in spec.left_out + (() if long else spec.long)]
        report = tmp_path / "report.xml"
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "cuda_on_cpu", "-q", "-rfEs",
                   f"--junitxml={report}", "--rootdir", str(tmp_path), *spec.options,
                   str(target.relative_to(tmp_path)), *(["-k", " and ".join(keep)] if keep else []), *extra]
        start = time.perf_counter()
        try:
            subprocess.run(command, cwd=tmp_path, env=env, timeout=timeout, check=False)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        seconds = time.perf_counter() - start
        return {**_counts(report), "seconds": seconds, "timed_out": timed_out}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=Path, default=DEFAULT_PEERS)
    parser.add_argument("--engine", nargs="+", choices=sorted(ENGINES), default=sorted(ENGINES))
    parser.add_argument("--backend", nargs="+", choices=("cpu", "torch"), default=["cpu", "torch"])
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per file and backend")
    parser.add_argument("--only", default="", help="run only the files whose path contains this text")
    parser.add_argument("--long", action="store_true", help="run the long cases too (the full run)")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    rows = []
    if "flashinfer" in args.engine:
        for path, why in FLASHINFER_NOT_RUN:
            print(f"not run: flashinfer {path}: {why}")
    for engine in args.engine:
        for spec in ENGINES[engine]:
            if args.only not in spec.path:
                continue
            for expr, why in spec.left_out:
                print(f"left out: {engine} {spec.path} -k 'not ({expr})': {why}")
            for expr, why in spec.long:
                print(f"long ({'run' if args.long else 'left out; --long runs it'}): {engine} {spec.path} "
                      f"-k '{expr}': {why}")
            for backend in args.backend:
                print(f"== {engine} {spec.path} @ {spec.commit[:12]} backend={backend}", flush=True)
                result = run_file(engine, spec, backend, args.peers, extra, args.timeout, args.long)
                rows.append((engine, spec, backend, result))
    print("\nengine      backend  passed failed skipped  seconds  file @ commit")
    failed = False
    for engine, spec, backend, r in rows:
        failed |= bool(r["failed"]) or bool(r["timed_out"])
        note = "  (timed out)" if r["timed_out"] else ""
        print(f"{engine:<11} {backend:<7} {r['passed']:>6} {r['failed']:>6} {r['skipped']:>7} {r['seconds']:>8.1f}  "
              f"{spec.path} @ {spec.commit[:12]}{note}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
