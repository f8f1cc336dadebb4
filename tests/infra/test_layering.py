"""The layering rule over dualop's import graph (every import statement, module-level or inside a
function): kernels import nothing from ops, layers, models or the tools; ops import nothing from
the tools or models; models reach kernels only through ops and layers. The tools are the
commands' modules: ``bench``, ``aot``, ``check``, ``cli``, ``fuzz``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dualop"
TOOLS = ("dualop.bench", "dualop.aot", "dualop.check", "dualop.cli", "dualop.fuzz")
LAYERS = ("dualop.torch", "dualop.jax")
# (importing package, packages it must not import)
RULES = [
    ("dualop.kernels", ("dualop.ops", "dualop.models", *LAYERS, *TOOLS)),
    ("dualop.backends", ("dualop.ops", "dualop.models", *LAYERS, *TOOLS)),
    ("dualop.ops", ("dualop.models", *TOOLS)),
    ("dualop.models", ("dualop.kernels", *TOOLS)),
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported dotted name) for every dualop import in ``path``; ``from dualop.a import b``
    yields ``dualop.a.b`` (a module or a name in ``dualop.a``: both sit under ``dualop.a``)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return [(line, name) for line, name in found if name == "dualop" or name.startswith("dualop.")]


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _violations() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for importer, forbidden in RULES:
            if not _under(module, importer):
                continue
            for line, name in _imports(path):
                hit = next((f for f in forbidden if _under(name, f)), None)
                if hit:
                    out.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} imports {name} ({importer} must not "
                               f"import {hit})")
    return out


def test_the_layering_rule_holds():
    assert _violations() == []


@pytest.mark.parametrize("source, importer, imported", [
    ("from dualop.ops.attention import paged_batch\n", "dualop/kernels/x.py", "dualop.ops.attention.paged_batch"),
    ("def f():\n    from dualop import check\n", "dualop/ops/x.py", "dualop.check"),
    ("import dualop.kernels.gate_math\n", "dualop/models/x.py", "dualop.kernels.gate_math"),
])
def test_the_rule_sees_every_kind_of_import(tmp_path, monkeypatch, source, importer, imported):
    """A forbidden import at module level, inside a function, or as ``import a.b`` is reported."""
    root = tmp_path / "dualop"
    target = root / importer.removeprefix("dualop/")
    target.parent.mkdir(parents=True)
    target.write_text(source)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", root)
    found = _violations()
    assert len(found) == 1 and imported in found[0], found
