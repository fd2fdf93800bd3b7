from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def base_model(tmp_path_factory):
    """The quickstart model after a few warm-up steps (enough for non-degenerate sampling)."""
    from torchtune_grpo.quickstart.prepare import prepare_quickstart

    return prepare_quickstart(tmp_path_factory.mktemp("base"), warmup_steps=20)
