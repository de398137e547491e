"""docs/configuration.md is what docs/generate_configuration.py writes from the schema: a key, a
default or a docstring changed in the schema and not in the page fails here, so the reference
never describes a job file that no longer exists."""

from __future__ import annotations

from pathlib import Path

from helpers import docs_generator as generator
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.training.config.schema import JobConfig

ROOT = Path(__file__).resolve().parents[2]


def test_the_configuration_page_is_generated_from_the_schema():
    page = ROOT / "docs" / "configuration.md"
    assert page.read_text() == generator().render(), (
        "docs/configuration.md is out of date with the schema: run `make docs` "
        "(.venv/bin/python docs/generate_configuration.py) and commit the page"
    )


def test_the_page_lists_every_section_and_key_of_both_job_files():
    """The generator walks both schemas whole: each section has its heading, each key its row
    with its default."""
    text = generator().render()
    for schema in (JobConfig, ManyModelsConfig):
        for name, section in schema.model_fields.items():
            assert f"### `[{section.alias or name}]`" in text
            model = section.annotation
            assert isinstance(model, type)
            for key, field in model.model_fields.items():
                assert f"| `{field.alias or key}` |" in text
    assert '| `async` | `"auto" \\| bool` | `"auto"` |' in text  # an alias, a union
    assert "| `steps` | `int`, > 0 | required |" in text
    assert "| `micro_batch` | `int \\| None`, > 0 | not set |" in text


def test_every_section_and_key_of_both_job_files_has_a_docstring():
    """The reference has no empty cell: each job file, each section class and each key has its
    own docstring (a section's, not one inherited from `Section`; a key's, the string literal
    right after it), so a key added without saying what it does fails here."""
    gen = generator()
    missing = []
    for schema in (JobConfig, ManyModelsConfig):
        if not gen.docstring(schema):
            missing.append(schema.__name__)
        for name, section in schema.model_fields.items():
            model = section.annotation
            assert isinstance(model, type)
            key = section.alias or name
            if not gen.docstring(model):
                missing.append(f"[{key}] ({model.__module__}.{model.__name__})")
            docs = gen.field_docstrings(model)
            missing += [
                f"{key}.{field.alias or inner}"
                for inner, field in model.model_fields.items()
                if not docs.get(inner)
            ]
    assert missing == [], f"no docstring, so an empty place in docs/configuration.md: {missing}"
