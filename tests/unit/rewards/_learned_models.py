"""Tiny HF folders for the learned-reward tests: a chat tokenizer, reward models and a judge.

Everything is written locally with ``tokenizers`` and ``transformers`` (a dev dependency):

- :func:`write_chat_tokenizer`: a byte-level BPE trained on a few sentences, ChatML special
  tokens, a ChatML chat template (``chat_template.jinja``); ``<|im_end|>`` ends a turn and
  pads.
- :func:`write_reward_model`: a random ``LlamaForSequenceClassification`` (or Qwen2) with one
  label and that tokenizer; returns the ``transformers`` model, the reference.
- :func:`write_judge`: a ``LlamaForCausalLM`` whose greedy reply to any prompt is ``reply``
  (one token, e.g. ``"7"``) then ``<|im_end|>``, by construction: every attention and MLP
  output projection is zero, so the last hidden state is the last token's own embedding; the
  embedding puts the ``reply`` token on one axis and every other token on another, and the
  output matrix maps the second axis to ``reply`` and the first to ``<|im_end|>``.
- :func:`with_local_reward_models`: a config whose learned-reward entries point at absent
  folders, with tiny folders (on the CPU, fp32) in their place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = [
    "What is 12 + 30? The answer is 42.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many.",
    "Rate the solution from 0 to 10. Reply with the number only. Score: 7",
    "system user assistant Problem Solution Reference answer yes no",
    "line one\nline two\n\n  indented 0123456789",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
#: Reward-model variants: (family, extra config keys).
RM_CASES = {
    "llama": ("llama", dict(rope_theta=50000.0)),
    "llama3_rope": ("llama", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "qwen2": ("qwen2", dict(rope_theta=1000000.0)),
}


def write_chat_tokenizer(folder: Path) -> Tokenizer:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja``."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
              "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
              "unk_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (folder / "chat_template.jinja").write_text(CHATML)
    return tok


def write_reward_model(folder: Path, case: str = "llama", seed: int = 0):
    """A random one-label sequence classifier plus the chat tokenizer in ``folder``.

    Returns:
        The ``transformers`` model (eval mode), the reference implementation.
    """
    import transformers

    tok = write_chat_tokenizer(folder)
    family, extra = RM_CASES[case]
    kwargs = {**SMALL, **extra, "vocab_size": tok.get_vocab_size(), "num_labels": 1,
              "pad_token_id": tok.token_to_id("<|im_end|>")}
    if family == "llama":
        model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**kwargs))
    else:
        model = transformers.Qwen2ForSequenceClassification(transformers.Qwen2Config(**kwargs))
    torch.manual_seed(seed)
    with torch.no_grad():  # not-small weights: a wrong mapping shows up clearly
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    model.eval()
    model.save_pretrained(folder)
    return model


def write_judge(folder: Path, reply: str = "7") -> None:
    """A causal Llama whose greedy reply to any prompt is ``reply`` then ``<|im_end|>``.

    ``reply`` must be a single token of the tokenizer (a digit is).
    """
    import transformers

    tok = write_chat_tokenizer(folder)
    reply_id, end_id = tok.token_to_id(reply), tok.token_to_id("<|im_end|>")
    assert reply_id is not None, f"{reply!r} is not one token"
    cfg = transformers.LlamaConfig(**SMALL, vocab_size=tok.get_vocab_size(),
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream is the token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, 1] = 1.0          # every token on axis 1 ...
        embed[reply_id, 1] = 0.0
        embed[reply_id, 0] = 1.0   # ... but the reply token on axis 0
        head = model.lm_head.weight
        head.zero_()
        head[reply_id, 1] = 10.0   # axis 1 -> the reply token
        head[end_id, 0] = 10.0     # the reply token -> end of turn
    model.save_pretrained(folder)


#: Learned-reward components and the tiny folder each needs.
LEARNED = {"RewardModelScore": write_reward_model, "GenerativeJudge": write_judge}


def with_local_reward_models(cfg: Any, root: Path) -> Any:
    """``cfg`` with each learned-reward entry whose ``model_dir`` is absent pointed at a tiny
    folder under ``root`` (device cpu, dtype fp32); other entries are unchanged."""
    for i, entry in enumerate(cfg.rewards):
        kind = str(entry.get("_component_", "")).rsplit(".", 1)[-1]
        if kind in LEARNED and not Path(str(entry.model_dir)).is_dir():
            folder = root / f"{kind}_{i}"
            if not folder.is_dir():
                LEARNED[kind](folder)
            entry.model_dir, entry.device, entry.dtype = str(folder), "cpu", "fp32"
    return cfg
