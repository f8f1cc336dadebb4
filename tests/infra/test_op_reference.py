"""The documentation's op reference page, generated from the registry and the specs when the site is
built (scripts/docs_hooks.py; tests/infra/test_docs.py builds the site)."""

from __future__ import annotations

from dualop import testing
from dualop.reference import op_reference_markdown


def test_every_registered_op_has_a_section_with_its_call_and_cells():
    from dualop.custom_op import CustomOp

    text = op_reference_markdown()
    for name in CustomOp.op_registry:
        section = text.split(f"### `{name}`", 1)
        assert len(section) == 2, name
        body = section[1].split("\n### ", 1)[0]
        assert "Call: `op(" in body, name
        has_cases = any(c.op == name for c in testing.cases_for(None))
        assert ("| torch | cpu |" in body) == has_cases and ("No check case" in body) != has_cases, name
