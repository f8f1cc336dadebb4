"""mkdocs hooks: the op reference page (docs/reference.md) is written when the site is built, from
the registry and the ops' specs (``dualop ops --markdown``), so an op added to ``dualop/ops/`` is in
the documentation without editing it."""

from __future__ import annotations


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != "reference.md":
        return markdown
    from dualop.reference import op_reference_markdown

    return op_reference_markdown()
