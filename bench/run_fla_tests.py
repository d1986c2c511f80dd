"""Run fla's own gated delta rule test file against torch_gdr, through the stand-in package.

    python bench/run_fla_tests.py PATH/TO/test_gdn.py [pytest arguments...]

fla's file (``tests/ops/test_gdn.py`` of flash-linear-attention; not shipped here, its code is
fla's) is copied into a temporary directory and run there by pytest with
``tests/fla_api_standin`` first on the path, so its ``import fla`` gets torch_gdr behind fla's
API, on the CPU. ``FLA_DISABLE_BACKEND_DISPATCH=1`` selects the file's baseline run (fla skips
its GQA cases otherwise, for a GPU backend). Deselected, with the reason: the tests of fla's
FlashQLA backend module (a CUDA backend of fla's own). The file's other hardware tests skip by
themselves on a CPU (Blackwell, SM120, FlashQLA parity), and the test of fla's WY internals
skips through the stand-in. Exit status: pytest's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "fla_api_standin"

#: test name -> why it is not run against torch_gdr
LEFT_OUT: dict[str, str] = {
    "test_flash_qla_verifier_rejects": "fla's FlashQLA backend module (fla.ops.gated_delta_rule.backends.flash_qla)",
    "test_flash_qla_verifier_sm120_accepts_forward": "fla's FlashQLA backend module, SM120 flag",
    "test_flash_qla_verifier_sm120_rejects_backward": "fla's FlashQLA backend module, SM120 flag",
    "test_flash_qla_verifier_sm120_rejects_float16": "fla's FlashQLA backend module, SM120 flag",
}


def main(argv: list[str]) -> int:
    if not argv or not Path(argv[0]).is_file():
        print(__doc__)
        return 2
    source, extra = Path(argv[0]), argv[1:]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(STANDIN), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                        else []))
    env["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
    with tempfile.TemporaryDirectory(prefix="torch_gdr_fla_tests_") as tmp:
        target = Path(tmp) / source.name
        shutil.copyfile(source, target)
        deselect = [arg for name in LEFT_OUT for arg in ("--deselect", f"{target.name}::{name}")]
        for name, why in LEFT_OUT.items():
            print(f"left out: {name}: {why}")
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", target.name, *deselect, *extra]
        return subprocess.call(command, cwd=tmp, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
