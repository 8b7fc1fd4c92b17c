"""docs/recipes.md is what ``python -m tools.recipes_doc`` writes from the config classes (issue 46,
item 3): a recipe field added, renamed, re-defaulted or re-documented without regenerating it fails
here, and so does a field without a docstring."""

import dataclasses

from tools import recipes_doc


def test_docs_recipes_md_is_current():
    assert recipes_doc.DOC.read_text() == recipes_doc.render(), (
        "docs/recipes.md is stale: run python -m tools.recipes_doc"
    )


def test_every_field_has_a_docstring_and_every_named_link_is_a_field():
    from moe_rl.config import Recipe

    undocumented = [
        f"{name}.{f.name}"
        for name, cls in recipes_doc.sections(Recipe)
        for f in dataclasses.fields(cls)
        if not recipes_doc.field_docs(cls).get(f.name)
    ]
    assert not undocumented, f"fields without a one-line docstring: {undocumented}"
    assert not recipes_doc.stale_links(), f"FIELD_DOCS names no field: {recipes_doc.stale_links()}"


def test_a_changed_field_makes_the_page_stale(monkeypatch):
    """A new default or docstring changes what the page would say."""
    from moe_rl import config

    before = recipes_doc.render()
    monkeypatch.setattr(config.OptimConfig.__dataclass_fields__["lr"], "default", 0.5)
    assert "| `optim.lr` | `0.5` |" in recipes_doc.render() != before
    monkeypatch.setattr(recipes_doc, "field_docs", lambda cls: {})
    assert "| `optim.lr` | `0.5` |  |" in recipes_doc.render()
