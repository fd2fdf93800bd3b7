"""Sphinx configuration of the torchtune-grpo documentation.

Build (warnings are errors, as in CI)::

    pip install -e ".[docs]"
    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))

project = "torchtune-grpo"
author = "torchtune-grpo contributors"
copyright = "torchtune-grpo contributors"
release = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "config_table",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "README.md"]

# Markdown: `{directive}` fences, ::: fences, heading anchors for "page.md#section" links.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc: Google-style docstrings, members in source order, signatures without type noise.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_default_options = {"members": True, "show-inheritance": False}
# Keep the build offline and fast: autodoc imports the package, so no heavy mocking is needed;
# the cross-references to torch/torchtune types are not resolved (no intersphinx download).
nitpicky = False

html_theme = "alabaster"
html_title = "torchtune-grpo"
html_static_path: list[str] = []
html_theme_options = {"description": "GRPO fine-tuning on top of torchtune", "fixed_sidebar": True}


# Topic pages that other contributors add when their feature lands. The how-to toctree of
# index.md holds the line OPTIONAL_TOPIC_PAGES, replaced at read time by those of these pages
# that exist, so the build passes before and after each page appears (and a present page is
# never left out of the navigation).
OPTIONAL_TOPIC_PAGES = ("performance", "memory", "defaults")


def _fill_optional_pages(app, docname: str, source: list[str]) -> None:
    if docname != "index":
        return
    present = [name for name in OPTIONAL_TOPIC_PAGES if (DOCS / f"{name}.md").is_file()]
    source[0] = source[0].replace("OPTIONAL_TOPIC_PAGES\n", "".join(f"{n}\n" for n in present))


def setup(app):
    app.connect("source-read", _fill_optional_pages)
