"""The documentation's op reference page is what the registry and the specs say today."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualop.reference import op_reference_markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"


@pytest.mark.latest_only
def test_the_op_reference_page_is_generated_from_the_registry_and_the_specs():
    """Regenerate with ``dualop ops --markdown > docs/reference.md`` when an op or its spec changes."""
    assert PAGE.read_text() == op_reference_markdown(), "docs/reference.md is stale: run dualop ops --markdown"


def test_every_registered_op_has_a_section():
    from dualop.custom_op import CustomOp

    text = op_reference_markdown()
    missing = [name for name in CustomOp.op_registry if f"### `{name}`" not in text]
    assert not missing
