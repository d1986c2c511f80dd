"""Run the serving engines' own GDN state-pool tests against torch_gdr, on the CPU.

    python bench/run_engine_tests.py [--peers DIR] [--engine vllm sglang flashinfer]
                                     [--backend cpu torch] [--timeout S] [--only TEXT] [-- pytest args...]

The engines' test files (vLLM, SGLang, FlashInfer; their code, not shipped here) are read
from ``DIR/<engine>/<commit>/<path in the repository>`` (default DIR: ``/work/peers``), the
commits recorded below in :data:`ENGINES`; nothing is downloaded. Each engine's files are
copied, unedited, into a temporary directory and run there by pytest with
``tests/engine_standins/<engine>`` first on the path (modules with the import names the
tests use, served by torch_gdr) and the plugin ``tests/engine_standins/cuda_on_cpu.py``
(the tests' CUDA tensors made on the CPU). ``TORCH_GDR_ENGINE_BACKEND`` picks the torch_gdr
backend the stand-ins call. Tests of the engines' own non-GDN code are left out, each with
its reason (printed); a sample of a very long file is selected with ``-k``, its filter
printed. Prints passed/failed/skipped per engine, file and backend; exit status 1 when a
test failed or errored.
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
    imports (``(commit, path)``, copied beside it), the tests left out (pytest ``-k``
    expressions, each with its reason) and pytest options of its own."""

    path: str
    commit: str
    imports: tuple[tuple[str, str], ...] = ()
    left_out: tuple[tuple[str, str], ...] = ()
    select: str = ""
    options: tuple[str, ...] = ()


_FLASHINFER = "fb28d7242b3506a2348265962041acc1fb56cca4"
#: beside each FlashInfer file: the package marker, the directory's conftest (its input
#: factory fixture) and the reference module the tests import relatively
_FLASHINFER_IMPORTS = tuple((_FLASHINFER, p) for p in ("tests/__init__.py", "tests/gdn/conftest.py",
                                                        "tests/gdn/reference_delta_rule.py"))
#: test_prefill_delta_rule.py has 3612 cases (3456 of them three large grids): every other
#: test, and of the grids the cases with the second sequence-length set, alpha and beta on
_FLASHINFER_PREFILL_SAMPLE = "not (kernel_basic or kernel_nonfull or chunked_prefill) or (seq_lens1 and True-True)"
#: test_decode_delta_rule.py (531 cases, over 3000 s in full on this CPU): the state-pool
#: families served through torch_gdr's public decode (FlashInfer's bf16-state CuTe kernels'
#: own tests and its fused-recovery kernels are left to the full run)
_FLASHINFER_DECODE_SAMPLE = ("decode_kernel_basic or decode_kernel_pretranspose_pool or packed_qkv or "
                             "output_state_indices or mtp_fp32_state_pool_non_contiguous")
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
        TestFile(f"tests/gdn/{name}", _FLASHINFER, imports=_FLASHINFER_IMPORTS, select=select,
                 options=("--import-mode=importlib",))  # FlashInfer's pytest.ini
        for name, select in (
            ("test_prefill_delta_rule.py", _FLASHINFER_PREFILL_SAMPLE),
            ("test_prefill_state_indices.py", ""),
            ("test_decode_pretranspose_noncontiguous_pool.py", ""),
            ("test_decode_pretranspose_bf16_padded_pool.py", ""),
            ("test_decode_delta_rule.py", _FLASHINFER_DECODE_SAMPLE),
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
             timeout: float) -> dict[str, object]:
    """Run one file on one backend; returns its counts and wall time."""
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
        keep = [f"not {expr}" for expr, _ in spec.left_out] + ([spec.select] if spec.select else [])
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
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    rows = []
    for engine in args.engine:
        for spec in ENGINES[engine]:
            if args.only not in spec.path:
                continue
            for expr, why in spec.left_out:
                print(f"left out: {engine} {spec.path} -k 'not {expr}': {why}")
            if spec.select:
                print(f"sample: {engine} {spec.path} -k '{spec.select}'")
            for backend in args.backend:
                print(f"== {engine} {spec.path} @ {spec.commit[:12]} backend={backend}", flush=True)
                rows.append((engine, spec, backend, run_file(engine, spec, backend, args.peers, extra, args.timeout)))
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
