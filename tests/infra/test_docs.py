"""The documentation builds and its code runs.

- ``mkdocs build --strict`` (broken links, pages missing from the nav and hook errors fail it),
  with the generated op reference page holding every registered op.
- Every ```` ```python ```` block of README.md and docs/**/*.md runs in a fresh interpreter, unless an
  HTML comment on the line before it (invisible on the site) says otherwise:
  ``<!-- docs-test: continues -->`` runs it after the page's previous block, in the same process;
  ``<!-- docs-test: fragment -->`` marks an API sketch whose inputs the page does not build (a
  checkpoint, a process group's rank): it is compiled and its imports are resolved, not run.
  Blocks marked ``<!-- tutorial-file: PATH -->`` are files a tutorial writes; tests/infra/test_tutorials.py
  runs them.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:^|\n)(?:<!-- (?P<marker>[^>]*?) -->\n)?```python\n(?P<code>.*?)\n```", re.S)


def _blocks():
    """(id, code to run, kind) for every python block; kind is "run" or "fragment"."""
    found = []
    for page in PAGES:
        previous = ""
        for index, match in enumerate(BLOCK.finditer(page.read_text())):
            marker, code = (match["marker"] or "").strip(), match["code"] + "\n"
            if marker.startswith("tutorial-file:"):
                continue
            name = f"{page.relative_to(ROOT)}:{index}"
            if marker == "docs-test: fragment":
                found.append(pytest.param(code, "fragment", id=name))
                continue
            if marker == "docs-test: continues":
                code = previous + code
            elif marker:
                raise ValueError(f"{name}: unknown marker <!-- {marker} -->")
            previous = code
            found.append(pytest.param(code, "run", id=name))
    return found


@pytest.mark.latest_only
def test_the_site_builds_strict_with_every_op_in_its_reference(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "--site-dir", str(tmp_path / "site")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    from dualop.custom_op import CustomOp

    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    assert all(f"<code>{name}</code>" in reference for name in CustomOp.op_registry)


@pytest.mark.latest_only
@pytest.mark.parametrize("code, kind", _blocks())
def test_code_block(code, kind, tmp_path):
    if kind == "fragment":
        tree = ast.parse(code)  # it compiles
        for node in ast.walk(tree):  # and what it imports exists
            if isinstance(node, ast.ImportFrom) and node.module:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                        f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert importlib.util.find_spec(alias.name) is not None, alias.name
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DUALOP_", "PYTEST"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
