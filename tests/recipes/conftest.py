from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def base_model(tmp_path_factory):
    """The quickstart model without warm-up (fast; quality does not matter here)."""
    from torchtune_grpo.quickstart import prepare_quickstart

    return prepare_quickstart(tmp_path_factory.mktemp("base"), warmup_steps=0)
