"""A Hub dataset that cannot be downloaded is one user error naming ``dataset.source`` and the
local alternative (the datasets library's own failure is a long traceback)."""

from __future__ import annotations

import pytest

from torchtune_grpo.errors import UserError, one_line


def test_an_unreachable_hub_is_one_line_naming_the_source_key(monkeypatch):
    import datasets

    from torchtune_grpo.datasets._loading import HubUnreachable, load_rows

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)"
                              "\nsecond line of the library's text")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(HubUnreachable) as info:
        load_rows("openai/gsm8k", name="main", split="test")
    assert isinstance(info.value, UserError) and isinstance(info.value, ConnectionError)
    message = str(info.value)
    assert "\n" not in message and message == one_line(message)
    assert message.startswith("dataset.source (or eval_dataset.source): could not download the "
                              "Hub dataset 'openai/gsm8k' (ConnectionError: Couldn't reach")
    assert "source=FILE.jsonl" in message and "HF_DATASETS_OFFLINE=1" in message


def test_a_dataset_missing_from_the_hub_is_not_called_unreachable(monkeypatch):
    import datasets

    from torchtune_grpo.datasets._loading import load_rows

    def missing(*args, **kwargs):
        raise FileNotFoundError("Dataset 'no/such' doesn't exist on the Hub or cannot be accessed")

    monkeypatch.setattr(datasets, "load_dataset", missing)
    with pytest.raises(FileNotFoundError, match="doesn't exist on the Hub"):
        load_rows("no/such", split="test")
