"""The documentation builds and its code runs.

- ``mkdocs build --strict`` succeeds (broken links, pages missing from the nav and hook errors fail
  it) and the generated op reference page names every registered op.
- Every ```` ```python ```` block of README.md and docs/**/*.md runs as its own test (id
  ``page:index``, the index counting the page's python blocks from 0), in a fresh interpreter
  (``sys.executable``, a temporary working directory, PYTHONPATH as it is, 120 s at most), and must
  exit 0. HTML comment lines right before the fence (invisible on the site; several may stack)
  say how:

  ``<!-- docs-test: continues -->``
      the block continues the page's previous python block: both run as one script, with the
      previous block's markers (its env, its ranks) and this one's.
  ``<!-- docs-test: env NAME=VALUE ... -->``
      run with these environment variables set, as the page tells a user to set them before
      starting Python (e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` for 8 host
      devices).
  ``<!-- docs-test: ranks N -->``
      run the block as N processes at once, one per ``torch.distributed`` rank, with the
      variables ``torchrun --nproc-per-node N`` sets (RANK, WORLD_SIZE, LOCAL_RANK,
      LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT); every rank must exit 0.
  ``<!-- docs-test: skip REASON -->``
      the block needs what no test machine has (a real TPU); the test is skipped with REASON.
  ``<!-- tutorial-file: PATH -->``
      a file a tutorial has the reader write; tests/infra/test_tutorials.py writes and runs those,
      so they are not collected here.

An unknown ``docs-test`` marker, or ``continues`` on a page's first block, fails collection.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.latest_only

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TIMEOUT_S = 120
MARKER = re.compile(r"<!--\s*(docs-test|tutorial-file):\s*(.*?)\s*-->")


@dataclass
class Block:
    """One python block, or the blocks it continues and it, as the script a test runs."""

    name: str
    code: str
    env: dict[str, str] = field(default_factory=dict)
    ranks: int = 1
    skip: str | None = None


def _page_name(page: Path) -> str:
    return str(page.relative_to(ROOT / "docs" if page.parent != ROOT else ROOT))


def _markers(lines: list[str], fence: int) -> list[tuple[str, str]]:
    """The (kind, text) of the comment lines stacked right before line ``fence``."""
    found = []
    i = fence - 1
    while i >= 0 and (m := MARKER.fullmatch(lines[i].strip())):
        found.insert(0, (m[1], m[2]))
        i -= 1
    return found


def page_blocks(page: Path) -> list[Block]:
    """The blocks of one page to run (tutorial files left out), markers applied."""
    lines = page.read_text().splitlines()
    name, blocks, previous, index, i = _page_name(page), [], None, 0, 0
    while i < len(lines):
        stripped = lines[i].lstrip()
        if not stripped.startswith("```"):
            i += 1
            continue
        indent, info = len(lines[i]) - len(stripped), stripped[3:].strip()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{name}: the code fence on line {i + 1} is never closed")
        if info.split(" ")[0] == "python":
            code = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
            block = Block(f"{name}:{index}", code)
            markers = _markers(lines, i)
            if any(kind == "tutorial-file" for kind, _ in markers):
                previous, block = None, None
            for kind, text in markers if block else ():
                word, _, rest = text.partition(" ")
                if word == "continues":
                    if previous is None:
                        raise ValueError(f"{block.name}: 'continues', but no python block to continue before it")
                    block = Block(block.name, previous.code + code, dict(previous.env), previous.ranks, previous.skip)
                elif word == "env" and rest:
                    for pair in rest.split():
                        key, eq, value = pair.partition("=")
                        if not eq:
                            raise ValueError(f"{block.name}: env marker entry {pair!r} is not NAME=VALUE")
                        block.env[key] = value
                elif word == "ranks" and rest.isdigit() and int(rest) > 1:
                    block.ranks = int(rest)
                elif word == "skip" and rest:
                    block.skip = rest
                else:
                    raise ValueError(f"{block.name}: unknown marker <!-- docs-test: {text} -->")
            if block is not None:
                blocks.append(block)
                previous = block
            index += 1
        i = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in page_blocks(page)]


def _child_env(block: Block) -> dict[str, str]:
    """This process's environment without the test run's own settings, plus the block's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DUALOP_", "PYTEST"))}
    env.update(block.env)
    return env


def _report(procs: list[subprocess.Popen], outputs: list[str]) -> str:
    return "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{out[-6000:]}" if len(procs) > 1
                     else f"--- exit {p.returncode} ---\n{out[-8000:]}"
                     for r, (p, out) in enumerate(zip(procs, outputs)))


def run_block(block: Block, cwd: Path) -> tuple[list[subprocess.Popen], list[str]]:
    """Run ``block`` as a script in ``cwd`` (``block.ranks`` processes); a rank that fails ends the
    others (they would wait for it in a collective until the timeout)."""
    script = cwd / "block.py"
    script.write_text(block.code)
    env = _child_env(block)
    if block.ranks > 1:
        from dualop.testing import free_port

        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(block.ranks),
                   LOCAL_WORLD_SIZE=str(block.ranks))
    logs = [cwd / f"rank{r}.log" for r in range(block.ranks)]
    procs = []
    for rank, log in enumerate(logs):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank)) if block.ranks > 1 else env
        with open(log, "w") as out:
            procs.append(subprocess.Popen([sys.executable, str(script)], cwd=cwd, env=rank_env, stdout=out,
                                          stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    while None in (codes := [p.poll() for p in procs]):
        timed_out = time.monotonic() > deadline
        if timed_out or any(code not in (None, 0) for code in codes):
            if not timed_out:
                time.sleep(5)  # the failed rank's peers get a moment to report their side
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if timed_out:
                pytest.fail(f"{block.name} ran past {TIMEOUT_S} s\n" + _report(procs, [f.read_text() for f in logs]))
            break
        time.sleep(0.05)
    return procs, [log.read_text() for log in logs]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_code_block(block: Block, tmp_path):
    if block.skip:
        pytest.skip(block.skip)
    procs, outputs = run_block(block, tmp_path)
    assert all(p.returncode == 0 for p in procs), f"{block.name} failed\n" + _report(procs, outputs)


def test_the_site_builds_strict_with_every_op_in_its_reference(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "--site-dir", str(tmp_path / "site")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    from dualop.custom_op import CustomOp

    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    missing = [name for name in CustomOp.op_registry if f"<code>{name}</code>" not in reference]
    assert not missing, f"the op reference page lacks {missing}"


def test_the_pages_name_no_issue_numbers_and_the_readme_stays_small():
    """Pages are for users: no tracker references ("issue 24", "#24"); README.md at most 12 KB."""
    tracker = re.compile(r"\bissues? ?#?\d+\b|(?<![\w/&'#])#\d+\b", re.I)
    found = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code (a fuzz item's #0) is not prose
        found += [f"{_page_name(page)}: {m[0]!r}" for m in tracker.finditer(text)]
    assert not found, found
    assert (ROOT / "README.md").stat().st_size <= 12 * 1024


def test_the_documented_from_pretrained_signature_is_the_real_one():
    """docs/models.md opens with ``from_pretrained``'s signature and a table of its parameters: the
    signature is the function's (names, order, defaults, the keyword-only star) and the table names
    each parameter once, in order."""
    import inspect

    from dualop.models import from_pretrained

    text = (ROOT / "docs" / "models.md").read_text()
    found = re.search(r"`dualop\.models\.from_pretrained(\(.*?\))`", text)
    assert found, "docs/models.md does not show dualop.models.from_pretrained(...)"
    namespace: dict = {}
    exec(f"def from_pretrained{found[1]}: pass", namespace)
    real = inspect.signature(from_pretrained)
    plain = real.replace(parameters=[p.replace(annotation=p.empty) for p in real.parameters.values()],
                         return_annotation=real.empty)
    assert str(inspect.signature(namespace["from_pretrained"])) == str(plain)
    table = text[found.end():].split("\n\n")[1]
    documented = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert documented == list(real.parameters), f"the parameter table names {documented}"
