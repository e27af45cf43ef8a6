"""The modules that moved in 0.2.0 still import by their old paths, with a
``LayergraphDeprecationWarning`` that names the importing line, until 0.3: the shape policy,
the token budgets and the gate into ``layergraph.serving``, the embedding service and its Ray
deployment into ``layergraph.service``."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import layergraph.service
import layergraph.serving.budgets
import layergraph.serving.gate
import layergraph.serving.policy
from layergraph import LayergraphDeprecationWarning


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("layergraph.policy", layergraph.serving.policy),
        ("layergraph.budgets", layergraph.serving.budgets),
        ("layergraph.gate", layergraph.serving.gate),
    ],
)
def test_an_old_module_path_is_the_new_module(old: str, new: object) -> None:
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is new
    (warning,) = [w for w in caught if issubclass(w.category, LayergraphDeprecationWarning)]
    assert f"{old} is {new.__name__} since layergraph 0.2.0" in str(warning.message)


def test_the_warning_names_the_users_import_line(tmp_path: Path) -> None:
    """In a plain script (pytest's import hook would stand between a test and the import)."""
    script = tmp_path / "user.py"
    script.write_text("import layergraph\n\nimport layergraph.policy\n")
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"{script}:3: LayergraphDeprecationWarning: layergraph.policy is" in done.stderr


def test_the_embedding_service_names_are_found_at_their_old_path() -> None:
    import layergraph.serving

    for name in ("ImageEncoder", "MicroBatcher", "EmbedBatches", "default_embed"):
        layergraph.serving.__dict__.pop(name, None)
        with pytest.warns(LayergraphDeprecationWarning, match=f"layergraph.service.{name} since"):
            found = getattr(layergraph.serving, name)
        assert found is getattr(layergraph.service, name)
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        layergraph.serving.Nothing  # noqa: B018
