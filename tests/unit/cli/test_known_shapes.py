"""``estimate-memory`` before the download: a ``config.json`` alone, else the known shapes of the
models the shipped configs name (``torchtune_grpo/cli/known_shapes.py``), checked against
torchtune's builders, the published parameter counts and the copies in this repository."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_grpo.cli.known_shapes import KNOWN_SHAPES, known_shape, repo_from_header
from torchtune_grpo.cli.memory_estimate import estimate_memory, model_dims, training_configs
from torchtune_grpo.config.loading import load_config, resolve_config_path

#: Parameters as the model cards state them (total; non-embedding where the card gives it),
#: in the card's rounding; Phi-4-mini exactly (a public record of its safetensors headers).
PUBLISHED = {
    "Qwen/Qwen2.5-0.5B-Instruct": ("0.49B", "0.36B"),
    "Qwen/Qwen2.5-1.5B-Instruct": ("1.54B", "1.31B"),
    "Qwen/Qwen2.5-3B-Instruct": ("3.09B", "2.77B"),
    "Qwen/Qwen3-0.6B": ("0.6B", "0.44B"),
    "Qwen/Qwen3-4B": ("4.0B", "3.6B"),
    "meta-llama/Llama-3.2-3B-Instruct": ("3.21B", None),
    "google/gemma-3-1b-it": ("1.0B", None),
    "google/gemma-3-270m": ("0.268B", "0.100B"),  # "170M embedding + 100M transformer"
    "microsoft/Phi-4-mini-instruct": (3_836_021_760, None),
    "HuggingFaceTB/SmolLM3-3B": ("3.08B", None),
    "HuggingFaceTB/SmolLM2-135M-Instruct": ("0.135B", None),
}
#: torchtune 0.6.1's builders of the same models (an independent copy of their shapes).
TORCHTUNE_BUILDERS = {
    "Qwen/Qwen2.5-0.5B-Instruct": "torchtune.models.qwen2_5.qwen2_5_0_5b",
    "Qwen/Qwen2.5-1.5B-Instruct": "torchtune.models.qwen2_5.qwen2_5_1_5b_instruct",
    "Qwen/Qwen2.5-3B-Instruct": "torchtune.models.qwen2_5.qwen2_5_3b",
    "meta-llama/Llama-3.2-3B-Instruct": "torchtune.models.llama3_2.llama3_2_3b",
}


def _folder(root: Path, repo: str, **changes) -> Path:
    """``root/<repo's name>`` holding only the known shape's config.json (with ``changes``)."""
    folder = root / repo.rsplit("/", 1)[-1]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**KNOWN_SHAPES[repo], **changes}))
    return folder


def _hf_node(folder: Path):
    return OmegaConf.create({"_component_": "torchtune_grpo.models.hf_model",
                             "model_dir": str(folder), "max_seq_len": 1024})


def _params(repo: str, tmp_path: Path) -> tuple[int, int]:
    from torchtune_grpo.models.builders import hf_model

    with torch.device("meta"):
        model = hf_model(str(_folder(tmp_path, repo)), max_seq_len=1024)
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.tok_embeddings.weight.numel()


# ---------------------------------------------------------------------------- the table
def test_every_shipped_model_has_a_known_shape():
    """Each training config reading a folder names a model of the table, by its header's
    download command (``--output-dir`` = ``model_dir``) and by the folder's name alike."""
    named = set()
    for name in training_configs():
        folder = load_config(name).model.get("model_dir")
        if folder is None:  # the quickstart builds its tiny model from the config's numbers
            continue
        header = resolve_config_path(name).read_text()
        found = known_shape(folder, header)
        assert found is not None, (name, folder)
        assert known_shape(folder)[0] == found[0], name  # a renamed copy of the folder too
        downloaded = repo_from_header(header, folder)
        assert downloaded in (None, found[0]), (name, downloaded)
        named.add(found[0])
    assert named == set(KNOWN_SHAPES)  # and the table holds nothing else


@pytest.mark.parametrize("repo", sorted(KNOWN_SHAPES))
def test_known_shapes_give_the_published_parameter_counts(repo, tmp_path):
    total, body = _params(repo, tmp_path)
    for count, published in zip((total, body), PUBLISHED[repo]):
        if isinstance(published, int):
            assert count == published, (repo, count)
        elif published is not None:
            digits = len(published[:-1].split(".")[1])
            assert f"{count / 1e9:.{digits}f}B" == published, (repo, count)


@pytest.mark.parametrize("repo", sorted(TORCHTUNE_BUILDERS))
def test_known_shapes_match_torchtune_builders(repo, tmp_path):
    """torchtune's Qwen2.5 and Llama 3.2 builders hard-code the released shapes: the table's
    config.json builds a model of the same dimensions and parameter count."""
    ours = model_dims(_hf_node(_folder(tmp_path, repo)))
    theirs = model_dims(OmegaConf.create({"_component_": TORCHTUNE_BUILDERS[repo]}))
    skip = {"max_seq_len", "source"}
    assert {k: v for k, v in vars(ours).items() if k not in skip} == {
        k: v for k, v in vars(theirs).items() if k not in skip}


def test_known_shapes_match_the_copies_in_the_tests():
    """The released config.json fields the family tests (and the shape benchmark) carry."""
    from benchmarks.family_shapes import SMOLLM2_SHAPE
    from tests.unit.models.families.test_gemma3 import GEMMA3_1B
    from tests.unit.models.families.test_mistral_smollm3 import SMOLLM3_3B
    from tests.unit.models.families.test_qwen3 import QWEN3_0_6B, QWEN3_4B

    copies = {"Qwen/Qwen3-0.6B": QWEN3_0_6B, "Qwen/Qwen3-4B": QWEN3_4B,
              "google/gemma-3-1b-it": GEMMA3_1B, "HuggingFaceTB/SmolLM3-3B": SMOLLM3_3B,
              "HuggingFaceTB/SmolLM2-135M-Instruct": SMOLLM2_SHAPE}
    for repo, copy in copies.items():
        ours = KNOWN_SHAPES[repo]
        shared = set(ours) & set(copy)
        assert {"hidden_size", "num_hidden_layers", "vocab_size"} <= shared, repo
        assert {k: ours[k] for k in shared} == {k: copy[k] for k in shared}, repo


def test_lookup_by_header_then_by_name():
    header = "#   tune download Qwen/Qwen3-4B --output-dir /data/weights\n"
    assert repo_from_header(header, "/data/weights") == "Qwen/Qwen3-4B"
    assert known_shape("/data/weights", header)[0] == "Qwen/Qwen3-4B"
    assert known_shape("/data/weights") is None  # the name alone says nothing
    # base and instruction-tuned weights share a shape; case does not matter
    assert known_shape("/models/qwen2.5-3b")[0] == "Qwen/Qwen2.5-3B-Instruct"
    assert known_shape("/models/gemma-3-270m-it")[0] == "google/gemma-3-270m"
    assert known_shape("/models/Qwen3-8B") is None


# ---------------------------------------------------------------------------- the estimate
def test_before_the_download_the_estimate_uses_the_known_shape_and_says_so(tmp_path):
    """``grpo/qwen3_4B_full`` with its folder absent: sized from Qwen/Qwen3-4B's released
    config.json, the same as from a folder holding that config.json alone, and the table
    says where the shape came from."""
    absent = tmp_path / "absent" / "Qwen3-4B"
    before = estimate_memory(load_config("grpo/qwen3_4B_full", [f"model_dir={absent}"]), 8,
                             name="grpo/qwen3_4B_full")
    assert before.dims.source == "Qwen/Qwen3-4B" and before.dims.num_layers == 36
    table = before.table()
    assert "shape: the released config.json of Qwen/Qwen3-4B" in table
    assert "after the download, run again" in table
    alone = _folder(tmp_path, "Qwen/Qwen3-4B")
    after = estimate_memory(load_config("grpo/qwen3_4B_full", [f"model_dir={alone}"]), 8,
                            name="grpo/qwen3_4B_full")
    assert after.dims.source is None and "shape:" not in after.table()
    assert after.phases == before.phases and after.components == before.components


def test_a_config_json_alone_is_read_before_the_table(tmp_path):
    """A folder with a config.json (no weights) is the model's shape, even where its name is
    a known model's: a 2-layer Qwen3-4B-named folder is sized as 2 layers."""
    folder = _folder(tmp_path, "Qwen/Qwen3-4B", num_hidden_layers=2)
    cfg = load_config("grpo/qwen3_4B_full", [f"model_dir={folder}"])
    dims = estimate_memory(cfg, 8, name="grpo/qwen3_4B_full").dims
    assert dims.num_layers == 2 and dims.source is None


def test_the_header_names_the_model_of_a_folder_of_any_name(tmp_path):
    folder = tmp_path / "weights"
    config = tmp_path / "mine.yaml"
    config.write_text(f"# tune download Qwen/Qwen3-0.6B --output-dir {folder}\n"
                      f"inherit: grpo/qwen3_0_6B_full_single_device\nmodel_dir: {folder}\n")
    est = estimate_memory(load_config(str(config)), 1, name=str(config))
    assert est.dims.source == "Qwen/Qwen3-0.6B" and est.dims.embed_dim == 1024


@pytest.mark.parametrize("exists", [False, True])
def test_an_unknown_folder_is_one_line_naming_what_to_do(tmp_path, capsys, exists):
    from torchtune_grpo.cli.main import main

    folder = tmp_path / "my-model"
    if exists:
        folder.mkdir()  # a download under way: the folder, no config.json yet
    args = ["estimate-memory", "--config", "grpo/qwen3_4B_full", f"model_dir={folder}"]
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err) == 1, err
    state = "has no config.json" if exists else "does not exist"
    assert f"model_dir {folder} {state}" in err[0]
    assert "put its config.json alone in that folder" in err[0] and "Qwen/Qwen3-4B" in err[0]


@pytest.mark.parametrize("name", ["grpo/qwen3_4B_full", "grpo/qwen3_0_6B_full_single_device"])
def test_cli_estimates_the_shipped_qwen3_configs_before_the_download(name, tmp_path, capsys):
    """The two configs of issue 52, run as shipped but for a model_dir that surely is absent
    (named as the shipped one)."""
    from torchtune_grpo.cli.main import main

    shipped = Path(str(load_config(name).model_dir))
    absent = tmp_path / shipped.name
    assert main(["estimate-memory", "--config", name, f"model_dir={absent}"]) == 0
    out = capsys.readouterr().out
    assert "PEAK" in out and f"released config.json of Qwen/{shipped.name}" in out
    assert main(["estimate-memory", "--config", name, f"model_dir={absent}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dims"]["source"] == f"Qwen/{shipped.name}"


def test_cli_estimates_every_shipped_training_config_before_the_download(tmp_path, capsys):
    """``tune-grpo estimate-memory`` on every shipped training config with its ``model_dir``
    at a folder that does not exist (named as the shipped one): each gives a figure, from its
    model's known shape; the quickstart configs (a model built from the config's own numbers)
    as shipped."""
    from torchtune_grpo.cli.main import main

    names = training_configs()
    assert len(names) >= 20
    for name in names:
        cfg = load_config(name)
        shipped = cfg.get("model_dir")
        absent = None if shipped is None else tmp_path / "absent" / Path(str(shipped)).name
        args = ["estimate-memory", "--config", name, "--json"]
        assert main(args + ([] if absent is None else [f"model_dir={absent}"])) == 0, name
        data = json.loads(capsys.readouterr().out)
        assert data["peak_bytes"] > 0 and data["peak_phase"] in data["phases"], name
        if cfg.model.get("model_dir") is not None:  # read from the (absent) folder
            assert not absent.exists()
            assert data["dims"]["source"] in KNOWN_SHAPES, name
