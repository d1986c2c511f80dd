"""The package's structure: layers import only downwards, no import cycles (function-level
imports included), one check of the inputs and one read of ``cu_seqlens`` per call."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_gdr
from tests.helpers import make_inputs

PACKAGE = Path(torch_gdr.__file__).resolve().parent

# The layers, bottom up: ref < ops < dispatch < distributed < functional < nn < integrations
# (the private top-level modules, _layout, _validate, _fallback, _paths..., sit below ref).
# layer: the layers above it, which it must not import
_ORDER = ("ref", "ops", "dispatch", "distributed", "functional", "nn", "integrations")
FORBIDDEN = {layer: _ORDER[i + 1:] for i, layer in enumerate(_ORDER)}
_PRIVATE = ("_layout", "_validate", "_fallback", "_device", "_paths", "_pool", "_gating", "_inplace")
FORBIDDEN.update({name: _ORDER for name in _PRIVATE})


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, top_level_only: bool = False) -> set[str]:
    """The torch_gdr modules ``name`` imports (with ``top_level_only``, at module level only;
    else inside functions too), and the names it imports from them as ``module.name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    found = set()
    for node in (tree.body if top_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}
    return {m for m in found if m.startswith("torch_gdr")}


def test_layers_import_only_downwards() -> None:
    violations = []
    for name, path in _modules().items():
        layer = name.split(".")[1] if name.count(".") else ""
        for above in FORBIDDEN.get(layer, ()):
            bad = sorted(m for m in _imports(name, path) if m == f"torch_gdr.{above}"
                         or m.startswith(f"torch_gdr.{above}."))
            violations += [f"{name} imports {m}" for m in bad]
    assert not violations, "\n".join(violations)


def test_no_import_cycles() -> None:
    """The graph of imports between the package's modules, function-level imports included,
    has no cycle."""
    modules = _modules()
    # a module importing its own package (``from . import x``) is no cycle: the package is
    # initialised first, by the import system, whatever the order
    graph = {name: {m for m in _imports(name, path)
                    if m in modules and m != name and not name.startswith(m + ".")}
             for name, path in modules.items()}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1 and not _is_package_of(nxt, node):
                raise AssertionError(" -> ".join(stack + [node, nxt]))
            if nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [])


def _is_package_of(package: str, module: str) -> bool:
    return module.startswith(package + ".")


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(_modules()))
def test_every_module_imports_alone(module: str) -> None:
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                            cwd=PACKAGE.parent, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def _count_calls(monkeypatch: pytest.MonkeyPatch, qualified: str) -> list:
    """Replace the function ``module.name`` wherever a torch_gdr module imported it; return
    the list its calls are appended to."""
    module_name, _, attr = qualified.rpartition(".")
    original = getattr(importlib.import_module(module_name), attr)
    calls: list = []

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    for name, mod in list(sys.modules.items()):
        if name.startswith("torch_gdr") and getattr(mod, attr, None) is original:
            monkeypatch.setattr(mod, attr, counting)
    return calls


@pytest.mark.parametrize("backend", ["torch", "recurrent"])
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_one_check_and_one_read_of_cu_seqlens_per_call(monkeypatch: pytest.MonkeyPatch, backend: str,
                                                       training: bool) -> None:
    inputs = make_inputs(seqlens=[5, 0, 20], num_qk_heads=1, num_v_heads=2, with_initial_state=True)
    if training:
        inputs = {n: (t.requires_grad_() if t.is_floating_point() else t) for n, t in inputs.items()}
    checks = _count_calls(monkeypatch, "torch_gdr._validate.check_inputs")
    reads = _count_calls(monkeypatch, "torch_gdr._validate.read_cu_seqlens")
    tolist = []
    real_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        if self.data_ptr() == inputs["cu_seqlens"].data_ptr():  # also a CPU copy that shares its data
            tolist.append(1)
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    o, _ = torch_gdr.chunk_gated_delta_rule(**inputs, output_final_state=True, backend=backend, chunk_size=16)
    assert len(checks) == 1 and len(reads) == 1 and len(tolist) == 1  # the one read (read_cu_seqlens)
    if training:
        o.sum().backward()  # the backward op reads the offsets once more, nothing else
        assert len(checks) == 1 and len(reads) == 2 and len(tolist) == 2


def test_the_op_called_directly_checks_once(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = make_inputs(seqlens=[5, 20])
    checks = _count_calls(monkeypatch, "torch_gdr._validate.check_inputs")
    torch.ops.gdr.chunked_gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                                           cu_seqlens=inputs["cu_seqlens"])
    assert len(checks) == 1
