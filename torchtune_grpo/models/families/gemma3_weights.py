"""Gemma 3 (text) weights: HF <-> torchtune names, and a checkpointer for HF Gemma 3 folders.

torchtune 0.6.1 has no Gemma 3 model type. :class:`Gemma3HFCheckpointer` reads and writes HF
folders as torchtune's ``FullModelHFCheckpointer`` does (the same files, shard names, index,
adapter files and copied config/tokenizer files), with this family's names:

================================================== =========================================
HF (``Gemma3ForCausalLM``)                         torchtune (:mod:`~.families.gemma3`)
================================================== =========================================
``model.embed_tokens.weight``                      ``tok_embeddings.weight``
``model.layers.{i}.self_attn.q_proj.weight``       ``layers.{i}.attn.q_proj.proj.weight``
``model.layers.{i}.self_attn.q_norm.weight``       ``layers.{i}.attn.q_proj.norm.scale``
``model.layers.{i}.self_attn.k_proj.weight``       ``layers.{i}.attn.k_proj.proj.weight``
``model.layers.{i}.self_attn.k_norm.weight``       ``layers.{i}.attn.k_proj.norm.scale``
``model.layers.{i}.self_attn.v_proj.weight``       ``layers.{i}.attn.v_proj.weight``
``model.layers.{i}.self_attn.o_proj.weight``       ``layers.{i}.attn.output_proj.weight``
``model.layers.{i}.mlp.gate_proj.weight``          ``layers.{i}.mlp.w1.weight``
``model.layers.{i}.mlp.down_proj.weight``          ``layers.{i}.mlp.w2.weight``
``model.layers.{i}.mlp.up_proj.weight``            ``layers.{i}.mlp.w3.weight``
``model.layers.{i}.input_layernorm``               ``layers.{i}.sa_norm.scale``
``model.layers.{i}.post_attention_layernorm``      ``layers.{i}.sa_scale.scale``
``model.layers.{i}.pre_feedforward_layernorm``     ``layers.{i}.mlp_norm.scale``
``model.layers.{i}.post_feedforward_layernorm``    ``layers.{i}.mlp_scale.scale``
``model.norm.weight``                              ``norm.scale``
``lm_head.weight`` (untied only)                   ``output.weight``
================================================== =========================================

Tensors keep their values, shapes and dtype: the Gemma norms store their weight as the offset
from 1 on both sides, and both RoPEs rotate halves, so nothing is permuted or shifted.
"""

from __future__ import annotations

import enum
import json
import re
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Gemma3HFCheckpointer",
    "gemma3_hf_to_tune",
    "gemma3_tune_to_hf",
    "gemma3_tune_to_peft_adapter",
]

_GLOBAL = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "output.weight",
}
_LAYER = {  # suffix after model.layers.{i}. -> suffix after layers.{i}.
    "self_attn.q_proj.weight": "attn.q_proj.proj.weight",
    "self_attn.q_norm.weight": "attn.q_proj.norm.scale",
    "self_attn.k_proj.weight": "attn.k_proj.proj.weight",
    "self_attn.k_norm.weight": "attn.k_proj.norm.scale",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.output_proj.weight",
    "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "mlp.up_proj.weight": "mlp.w3.weight",
    "input_layernorm.weight": "sa_norm.scale",
    "post_attention_layernorm.weight": "sa_scale.scale",
    "pre_feedforward_layernorm.weight": "mlp_norm.scale",
    "post_feedforward_layernorm.weight": "mlp_scale.scale",
}
_LAYER_TO_HF = {v: k for k, v in _LAYER.items()}
_GLOBAL_TO_HF = {v: k for k, v in _GLOBAL.items()}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TUNE_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def _hf_name(tune_key: str) -> str:
    match = _TUNE_LAYER.match(tune_key)
    if match and match.group(2) in _LAYER_TO_HF:
        return f"model.layers.{match.group(1)}.{_LAYER_TO_HF[match.group(2)]}"
    if tune_key in _GLOBAL_TO_HF:
        return _GLOBAL_TO_HF[tune_key]
    raise ValueError(f"Gemma 3 weights: no HF name for the torchtune weight {tune_key!r}")


def gemma3_hf_to_tune(state_dict: dict[str, torch.Tensor], *, tie_word_embeddings: bool,
                      where: str = "the checkpoint") -> dict[str, torch.Tensor]:
    """HF ``Gemma3ForCausalLM`` weights -> the torchtune names of :func:`~.gemma3.gemma3`.

    Args:
        state_dict: HF name -> tensor (all shards merged).
        tie_word_embeddings: drop ``lm_head.weight`` (the output is the embedding table).
        where: how to name the source in messages.

    Raises:
        ValueError: a weight a text-only Gemma 3 does not have (a vision tower, a bias).
    """
    out = {}
    for key, value in state_dict.items():
        if key.endswith("rotary_emb.inv_freq") or (tie_word_embeddings and key == "lm_head.weight"):
            continue
        match = _HF_LAYER.match(key)
        if match and match.group(2) in _LAYER:
            out[f"layers.{match.group(1)}.{_LAYER[match.group(2)]}"] = value
        elif key in _GLOBAL:
            out[_GLOBAL[key]] = value
        else:
            raise ValueError(f"{where}: weight {key!r} is not part of a text-only "
                             "Gemma3ForCausalLM; is config.json's architecture right?")
    return out


def gemma3_tune_to_hf(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchtune Gemma 3 weights -> HF ``Gemma3ForCausalLM`` names (tensors unchanged).

    Raises:
        ValueError: a name without an HF counterpart (LoRA keys: merge adapters first).
    """
    return {_hf_name(key): value for key, value in state_dict.items()}


def gemma3_tune_to_peft_adapter(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchtune LoRA/DoRA adapter weights -> PEFT names for an HF Gemma 3 base model
    (``layers.{i}.attn.q_proj.proj.lora_a.weight`` ->
    ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``)."""
    out = {}
    for key, value in adapter.items():
        for tune_part, peft_part in ((".lora_a.weight", ".lora_A.weight"),
                                     (".lora_b.weight", ".lora_B.weight"),
                                     (".magnitude", ".lora_magnitude_vector")):
            if key.endswith(tune_part):
                base = _hf_name(key[: -len(tune_part)] + ".weight")
                out["base_model.model." + base[: -len(".weight")] + peft_part] = value
                break
        else:
            raise ValueError(f"Gemma 3 adapter: {key!r} is not a LoRA/DoRA weight")
    return out


class Gemma3ModelType(enum.Enum):
    """The checkpointer's model type (torchtune's ``ModelType`` has no Gemma 3 member)."""

    GEMMA3 = "gemma3"


class Gemma3HFCheckpointer:
    """Reads and writes an HF Gemma 3 folder in torchtune names, like ``FullModelHFCheckpointer``.

    Args:
        checkpoint_dir: the HF folder (``config.json`` and the weight files).
        checkpoint_files: weight file names in it (sharded ``*.safetensors`` or ``*.bin``).
        output_dir: where :meth:`save_checkpoint` writes ``epoch_{epoch}/``.
        model_type: ``"GEMMA3"`` (the only one).
        safe_serialization: write ``*.safetensors`` (else ``*.bin``).
        **unsupported: torchtune's resume arguments (``should_load_recipe_state``,
            ``adapter_checkpoint``, ``recipe_checkpoint``, ``resume_from_checkpoint``) may be
            given only as false/None: the recipes resume from step folders.

    The attributes the recipes read are torchtune's: ``_config`` (``config.json``),
    ``_model_type`` (:attr:`Gemma3ModelType.GEMMA3`), ``_output_dir`` and ``_weight_map`` (HF
    name -> 1-based shard id such as ``"0001"``, set by :meth:`load_checkpoint`).
    """

    def __init__(self, checkpoint_dir: str, checkpoint_files: list[str], output_dir: str,
                 model_type: str = "GEMMA3", safe_serialization: bool = True,
                 **unsupported: Any) -> None:
        from torchtune.training.checkpointing._utils import check_outdir_not_in_ckptdir

        if str(model_type).upper() != "GEMMA3":
            raise ValueError(f"Gemma3HFCheckpointer: model_type {model_type!r}; only GEMMA3")
        given = sorted(k for k, v in unsupported.items() if v)
        if given:
            raise ValueError(f"checkpointer: {given} not supported for Gemma 3 folders (resume "
                             "with resume_from_checkpoint at the top level of the config)")
        self._checkpoint_dir = Path(checkpoint_dir)
        self._checkpoint_files = list(checkpoint_files)
        self._output_dir = Path(output_dir)
        check_outdir_not_in_ckptdir(ckpt_dir=self._checkpoint_dir, out_dir=self._output_dir)
        self._output_dir.mkdir(parents=True, exist_ok=True)
        self._safe_serialization = safe_serialization
        self._model_type = Gemma3ModelType.GEMMA3
        self._config: dict[str, Any] = json.loads((self._checkpoint_dir / "config.json")
                                                  .read_text())
        self._weight_map: dict[str, str] | None = None
        repo = self._checkpoint_dir / "original_repo_id.json"
        self.repo_id = json.loads(repo.read_text()).get("repo_id") if repo.is_file() else None

    @property
    def _tied(self) -> bool:
        return bool(self._config.get("tie_word_embeddings", True))

    def load_checkpoint(self) -> dict[str, Any]:
        """``{"model": torchtune-named weights}`` from every checkpoint file, shards merged."""
        from torchtune import training
        from torchtune.training.checkpointing._utils import safe_torch_load

        merged: dict[str, torch.Tensor] = {}
        self._weight_map = {}
        for index, name in enumerate(sorted(self._checkpoint_files)):
            path = self._checkpoint_dir / name
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint file {path} not found")
            for key, value in safe_torch_load(path).items():
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"{path}: {key!r} is not a tensor")
                self._weight_map[key] = f"{index + 1:04}"
                merged[key] = value
        model = gemma3_hf_to_tune(merged, tie_word_embeddings=self._tied,
                                 where=str(self._checkpoint_dir))
        return {training.MODEL_KEY: model}

    def _write(self, tensors: dict[str, torch.Tensor], path: Path) -> Path:
        from safetensors.torch import save_file

        if self._safe_serialization:
            path = path.with_suffix(".safetensors")
            save_file(tensors, str(path), metadata={"format": "pt"})
        else:
            path = path.with_suffix(".bin")
            torch.save(tensors, path)
        return path

    def _save_model(self, weights: dict[str, torch.Tensor], folder: Path) -> None:
        """HF-named shards as the input was split, and their index file."""
        from torchtune.training.checkpointing._utils import (
            SAFETENSOR_INDEX_FNAME,
            SHARD_FNAME,
            TORCH_INDEX_FNAME,
        )

        hf = gemma3_tune_to_hf(weights)
        shard_of = self._weight_map or {key: "0001" for key in hf}
        missing = sorted(set(hf) - set(shard_of))
        if missing:
            raise ValueError(f"Gemma 3 checkpointer: {missing[:3]} were not in the loaded "
                             "checkpoint; the model does not match its config.json")
        shards: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in hf.items():
            shards.setdefault(shard_of[key], {})[key] = value
        total = sum(v.numel() * v.element_size() for v in hf.values())
        index: dict[str, str] = {}
        for number, shard in enumerate(sorted(shards), start=1):
            name = SHARD_FNAME.format(cpt_idx=f"{number}".zfill(5),
                                      num_shards=f"{len(shards)}".zfill(5))
            written = self._write(shards[shard], folder / name)
            index.update({key: written.name for key in shards[shard]})
        index_name = SAFETENSOR_INDEX_FNAME if self._safe_serialization else TORCH_INDEX_FNAME
        (folder / index_name).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": index}, indent=2))

    def save_checkpoint(self, state_dict: dict[str, Any], epoch: int,
                        intermediate_checkpoint: bool = False, adapter_only: bool = False
                        ) -> None:
        """Write ``output_dir/epoch_{epoch}/`` as ``FullModelHFCheckpointer`` does.

        Args:
            state_dict: ``"model"`` (torchtune names), and for LoRA ``"adapter"`` and
                ``"adapter_config"``; other keys are recipe state.
            epoch: the folder's number.
            intermediate_checkpoint: also write the remaining keys to
                ``output_dir/recipe_state/recipe_state.pt``.
            adapter_only: write the adapter files only.

        Raises:
            ValueError: ``adapter_only`` without adapter weights.
        """
        from torchtune import training
        from torchtune.models.convert_weights import tune_to_peft_adapter_config
        from torchtune.training.checkpointing._utils import (
            ADAPTER_CONFIG_FNAME,
            ADAPTER_MODEL_FNAME,
            RECIPE_STATE_DIRNAME,
            SUFFIXES_TO_NOT_COPY,
            copy_files,
        )

        folder = self._output_dir / f"epoch_{epoch}"
        folder.mkdir(parents=True, exist_ok=True)
        if not adapter_only:
            self._save_model(state_dict[training.MODEL_KEY], folder)
        if training.ADAPTER_KEY in state_dict:
            adapter = state_dict[training.ADAPTER_KEY]
            torch.save(adapter, (folder / ADAPTER_MODEL_FNAME).with_suffix(".pt"))
            self._write(gemma3_tune_to_peft_adapter(adapter), folder / ADAPTER_MODEL_FNAME)
        elif adapter_only:
            raise ValueError("adapter_only: the state dict holds no adapter weights")
        if training.ADAPTER_CONFIG in state_dict:
            config = tune_to_peft_adapter_config(
                adapter_config=dict(state_dict[training.ADAPTER_CONFIG]),
                base_model_name_or_path=self.repo_id)
            (folder / f"{ADAPTER_CONFIG_FNAME}.json").write_text(json.dumps(config))
        copy_files(self._checkpoint_dir, folder, ignore_suffixes=SUFFIXES_TO_NOT_COPY)
        if intermediate_checkpoint:
            rest = {k: v for k, v in state_dict.items() if k not in (
                training.MODEL_KEY, training.ADAPTER_KEY, training.ADAPTER_CONFIG)}
            path = self._output_dir / RECIPE_STATE_DIRNAME / "recipe_state.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(rest, path)
