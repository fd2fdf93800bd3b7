"""Learned rewards: a reward model's score, or a judge model's verdict, as a reward component.

Both models are built and loaded when the component is constructed (before the policy), run
frozen on their own ``device``, and follow the reward-component interface of
:mod:`torchtune_grpo.rewards.components`. ``docs/rewards.md`` shows their config.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from torchtune_grpo.rewards.learned.inputs import (
    JUDGE_FIELDS,
    check_count,
    folder_tokenizer,
    last_position_scores,
    pad_left,
    pad_right,
    questions_of,
    resolve_device,
    resolve_dtype,
    template_fields,
)
from torchtune_grpo.rewards.learned.judge_parsers import make_parser

__all__ = ["GenerativeJudge", "RewardModelScore"]

_QUOTE = 300  # characters of a judge reply quoted in an error


# ---------------------------------------------------------------------------- reward model
class RewardModelScore:
    """The score of a sequence-classification reward model, one per completion.

    Each ``[user: question, assistant: completion]`` is rendered with the folder's chat template;
    the score is the classifier's output at the last token, ``batch_size`` sequences per forward.
    A sequence longer than ``max_seq_len`` keeps its last ``max_seq_len`` tokens
    (``truncation="left"``) or raises (``"error"``).

    Args:
        model_dir: an HF folder (``LlamaForSequenceClassification`` or
            ``Qwen2ForSequenceClassification``, ``num_labels`` 1) with weights and tokenizer.
        device: where the reward model runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        dtype: ``"fp32"`` or ``"bf16"``.
        batch_size: sequences per forward.
        max_seq_len: the most tokens scored per sequence (and the RoPE cache length).
        truncation: ``"left"`` or ``"error"``.
        normalize: ``"none"`` (the raw score) or ``"sigmoid"`` (in ``(0, 1)``).
        chat_template: a jinja chat template (or a file path) that replaces the folder's.

    Raises:
        FileNotFoundError: the folder, its ``config.json``, ``tokenizer.json`` or weights are
            missing.
        ValueError: an unsupported architecture, ``num_labels`` other than 1, weights that do
            not fit ``config.json``, a folder without chat template, or a bad argument (named).

    Attributes:
        model: the frozen torchtune classifier (``[b, s]`` ids -> ``[b, s, 1]`` scores).
        tokenizer: the folder's :class:`~torchtune_grpo.models.HFTokenizer`.
        last_truncated: sequences truncated in the last call.
        last_counts: ``{"truncated": last_truncated}`` (logged as ``reward/<name>/truncated``).
    """

    name = "reward_model"

    @property
    def last_counts(self) -> dict[str, int]:
        """Counters of the last call, for the recipe's metrics (see
        :data:`~torchtune_grpo.rewards.reward_set.COUNTS_ATTRIBUTE`)."""
        return {"truncated": int(self.last_truncated)}

    def __init__(self, model_dir: str, *, device: str = "cpu", dtype: str = "fp32",
                 batch_size: int = 8, max_seq_len: int = 4096, truncation: str = "left",
                 normalize: str = "none", chat_template: str | None = None) -> None:
        from pathlib import Path

        from torchtune_grpo.models.builders import read_hf_config
        from torchtune_grpo.models.classifier import (
            build_classifier,
            classifier_hf_to_tune,
            frozen_model,
            hf_classifier_architecture,
            read_hf_weights,
        )

        where = f"RewardModelScore({model_dir})"
        self.batch_size = check_count(batch_size, "batch_size", where)
        self.max_seq_len = check_count(max_seq_len, "max_seq_len", where)
        if truncation not in ("left", "error"):
            raise ValueError(f"{where}: truncation must be 'left' or 'error', got {truncation!r}")
        if normalize not in ("none", "sigmoid"):
            raise ValueError(f"{where}: normalize must be 'none' or 'sigmoid', got {normalize!r}")
        self.truncation, self.normalize = truncation, normalize
        self.device, self.dtype = resolve_device(device, where), resolve_dtype(dtype, where)
        self.model_dir = str(Path(model_dir).expanduser())
        cfg = read_hf_config(self.model_dir)
        arch = hf_classifier_architecture(cfg, where=f"{self.model_dir}/config.json",
                                          max_seq_len=self.max_seq_len)
        self.tokenizer = folder_tokenizer(self.model_dir, chat_template, where)
        weights = classifier_hf_to_tune(read_hf_weights(self.model_dir), arch)
        bias = "output.bias" in weights
        self.model = frozen_model(lambda: build_classifier(arch, bias=bias), weights,
                                  device=self.device, dtype=self.dtype, where=self.model_dir)
        del weights
        self.last_truncated = 0

    def encode(self, question: str, completion: str) -> list[int]:
        """Token ids (not truncated) of ``[user: question, assistant: completion]`` in the folder's
        template.
        """
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}, {"role": "assistant", "content": completion}])
        return self.tokenizer.encode(text, add_bos=False, add_eos=False)

    def score_ids(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """Raw scores of ``N`` non-empty id lists of at most ``max_seq_len`` ids: ``[N]``
        float32 on the CPU."""
        out = []
        for start in range(0, len(sequences), self.batch_size):
            tokens, lengths = pad_right(sequences[start : start + self.batch_size],
                                        self.tokenizer.pad_id)
            with torch.inference_mode():
                scores = self.model(tokens.to(self.device))  # [b, L, 1]
                out.append(last_position_scores(scores[..., 0].float(), lengths).cpu())
            del scores
        return torch.cat(out) if out else torch.zeros(0)

    def __call__(self, completions: list[str], answers: list[str], **kwargs: Any) -> list[float]:
        """Score ``N`` completions (``questions`` required in ``kwargs``; ``answers`` unused).

        Raises:
            ValueError: no ``questions``, or (``truncation="error"``) a sequence longer than
                ``max_seq_len``, naming the sample.
        """
        where = "RewardModelScore"
        self.last_truncated = 0
        questions = questions_of(kwargs, len(completions), where)
        sequences, truncated = [], 0
        for i, (question, completion) in enumerate(zip(questions, completions, strict=True)):
            ids = self.encode(question, completion)
            if len(ids) > self.max_seq_len:
                if self.truncation == "error":
                    raise ValueError(
                        f"{where}: sample {i} has {len(ids)} tokens in the reward model's chat "
                        f"template, more than max_seq_len={self.max_seq_len}; raise "
                        "max_seq_len or set truncation: left")
                ids, truncated = ids[-self.max_seq_len:], truncated + 1
            sequences.append(ids)
        self.last_truncated = truncated
        scores = self.score_ids(sequences)
        if self.normalize == "sigmoid":
            scores = torch.sigmoid(scores)
        return scores.tolist()


# ---------------------------------------------------------------------------- judge
class GenerativeJudge:
    """A chat model asked to grade each completion; its greedy reply, parsed, is the score.

    ``prompt_template`` is filled by ``str.format`` with ``{question}``, ``{completion}`` and
    ``{answer}``, sent as one user turn, and answered greedily by the package's KV-cache engine. A
    reply without a score raises (``on_parse_failure="error"``) or scores the given number; a
    prompt longer than ``max_seq_len - max_generated_tokens`` raises.

    Args:
        model_dir: an HF causal-LM folder with its weights and tokenizer.
        prompt_template: the user message; names any of ``{question}``, ``{completion}``,
            ``{answer}``.
        parser: ``number``, ``last_number``, ``yes_no`` or ``regex:<pattern>``
            (:func:`~torchtune_grpo.rewards.learned.judge_parsers.make_parser`).
        on_parse_failure: ``"error"``, or the score (a finite number) of an unparsable reply.
        score_range: ``[lo, hi]`` to rescale parsed scores to ``[0, 1]`` (outside: a parse
            failure), or ``None``.
        max_generated_tokens: the longest reply.
        batch_size: prompts per generation batch.
        device: where the judge runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        dtype: ``"fp32"`` or ``"bf16"``.
        max_seq_len: the judge's context (prompt plus reply).
        system_prompt: a system message before the user turn, or ``None``.
        chat_template: a jinja chat template (or a file path) that replaces the folder's.

    Raises:
        FileNotFoundError: the folder, its ``config.json``, ``tokenizer.json`` or weights are
            missing.
        ValueError: an unknown template field (named), an unknown parser, a bad
            ``on_parse_failure`` or ``score_range``, an unsupported architecture, a folder
            without chat template.

    Attributes:
        model: the frozen torchtune decoder.
        tokenizer: the folder's :class:`~torchtune_grpo.models.HFTokenizer`.
        last_replies: the judge's replies of the last call.
        last_parse_failures: replies of the last call that did not parse.
        parse_failures: replies that did not parse, over all calls.
        last_counts: ``{"parse_failures": last_parse_failures}`` (logged as
            ``reward/<name>/parse_failures``).
    """

    name = "judge"

    @property
    def last_counts(self) -> dict[str, int]:
        """Counters of the last call, for the recipe's metrics (see
        :data:`~torchtune_grpo.rewards.reward_set.COUNTS_ATTRIBUTE`)."""
        return {"parse_failures": int(self.last_parse_failures)}

    def __init__(self, model_dir: str, prompt_template: str, *, parser: str = "number",
                 on_parse_failure: str | float = "error", score_range: list[float] | None = None,
                 max_generated_tokens: int = 32, batch_size: int = 8, device: str = "cpu",
                 dtype: str = "fp32", max_seq_len: int = 2048, system_prompt: str | None = None,
                 chat_template: str | None = None) -> None:
        import tempfile
        from pathlib import Path

        from torchtune import training

        from torchtune_grpo.models import hf_checkpointer
        from torchtune_grpo.models.builders import hf_model, read_hf_config
        from torchtune_grpo.models.classifier import frozen_model
        from torchtune_grpo.policy.model import token_rules

        where = f"GenerativeJudge({model_dir})"
        if not isinstance(prompt_template, str) or not prompt_template.strip():
            raise ValueError(f"{where}: prompt_template must be a non-empty string")
        unknown = sorted(template_fields(prompt_template) - set(JUDGE_FIELDS))
        if unknown:
            raise ValueError(f"{where}: prompt_template names the unknown field {{{unknown[0]}}}; "
                             f"the fields are {', '.join('{' + f + '}' for f in JUDGE_FIELDS)}")
        self.prompt_template = prompt_template
        self.fields = template_fields(prompt_template)
        self.parser_spec, self._parse = parser, make_parser(parser)
        if on_parse_failure != "error" and (isinstance(on_parse_failure, bool)
                                            or not isinstance(on_parse_failure, numbers.Real)
                                            or not math.isfinite(on_parse_failure)):
            raise ValueError(f"{where}: on_parse_failure must be 'error' or a finite number, got "
                             f"{on_parse_failure!r}")
        self.on_parse_failure = on_parse_failure
        self.score_range = None
        if score_range is not None:
            lo_hi = list(score_range)
            if (len(lo_hi) != 2 or not all(isinstance(v, numbers.Real) and not isinstance(v, bool)
                                           and math.isfinite(v) for v in lo_hi)
                    or not lo_hi[0] < lo_hi[1]):
                raise ValueError(f"{where}: score_range must be [lo, hi] with lo < hi, got "
                                 f"{score_range!r}")
            self.score_range = (float(lo_hi[0]), float(lo_hi[1]))
        self.max_generated_tokens = check_count(max_generated_tokens, "max_generated_tokens",
                                                 where)
        self.batch_size = check_count(batch_size, "batch_size", where)
        self.max_seq_len = check_count(max_seq_len, "max_seq_len", where)
        if self.max_generated_tokens >= self.max_seq_len:
            raise ValueError(f"{where}: max_generated_tokens ({max_generated_tokens}) must be "
                             f"below max_seq_len ({max_seq_len})")
        self.system_prompt = system_prompt
        self.device, self.dtype = resolve_device(device, where), resolve_dtype(dtype, where)
        self.model_dir = str(Path(model_dir).expanduser())
        read_hf_config(self.model_dir)  # a missing folder or config.json, named
        self.tokenizer = folder_tokenizer(self.model_dir, chat_template, where)
        with tempfile.TemporaryDirectory(prefix="grpo_judge_") as scratch:
            checkpointer = hf_checkpointer(self.model_dir, output_dir=scratch)
            weights = checkpointer.load_checkpoint()[training.MODEL_KEY]
        self.model = frozen_model(lambda: hf_model(self.model_dir, max_seq_len=self.max_seq_len),
                                  weights, device=self.device, dtype=self.dtype,
                                  where=self.model_dir)
        del weights
        self._rules = token_rules(self.tokenizer, self.model, self.device)
        self.last_replies: list[str] = []
        self.last_parse_failures = 0
        self.parse_failures = 0

    def prompt_ids(self, question: str, completion: str, answer: str) -> list[int]:
        """Token ids of the judge prompt for one completion, the assistant turn opened."""
        values = {"question": question, "completion": completion, "answer": answer}
        messages = [{"role": "user", "content": self.prompt_template.format(**values)}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_bos=False, add_eos=False)

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[str]:
        """The judge's greedy replies to ``N`` non-empty prompt id lists (stop and special
        tokens left out), ``batch_size`` at a time."""
        from torchtune_grpo.rollout.native import generate_trajectory
        from torchtune_grpo.rollout.protocol import GenerationRequest
        from torchtune_grpo.rollout.sampling import decode_completions

        replies: list[str] = []
        rules = self._rules
        for start in range(0, len(prompts), self.batch_size):
            tokens, mask = pad_left(prompts[start : start + self.batch_size], rules.pad_id)
            with torch.no_grad():  # not inference_mode: the engine memoises by version counter
                traj = generate_trajectory(self.model, GenerationRequest(
                    tokens.to(self.device), mask.to(self.device), group_size=1,
                    forward_batch_size=tokens.shape[0],
                    max_generated_tokens=self.max_generated_tokens, temperature=0.0, top_k=None,
                    stop_tokens=rules.stop_tokens, pad_id=rules.pad_id,
                    logit_bias=rules.logit_bias, cache_dtype=self.dtype))
            replies.extend(decode_completions(self.tokenizer, traj, rules.allowed))
            del traj
        return replies

    def parse(self, reply: str) -> float | None:
        """The score of one reply: parsed, checked against and rescaled by ``score_range``.

        Returns:
            The score, or ``None`` when the reply holds none (or one outside ``score_range``).
        """
        value = self._parse(reply)
        if value is None or self.score_range is None:
            return value
        lo, hi = self.score_range
        if not lo <= value <= hi:
            return None
        return (value - lo) / (hi - lo)

    def __call__(self, completions: list[str], answers: list[str], **kwargs: Any) -> list[float]:
        """Grade ``N`` completions (``questions`` needed when the template names it).

        Raises:
            ValueError: a reply without a score with ``on_parse_failure="error"`` (naming the
                sample and quoting the reply), a prompt too long for ``max_seq_len``, or no
                ``questions`` for a template that names ``{question}``.
        """
        where = "GenerativeJudge"
        self.last_parse_failures = 0
        n = len(completions)
        questions = questions_of(kwargs, n, where) if "question" in self.fields else [""] * n
        limit = self.max_seq_len - self.max_generated_tokens
        prompts = []
        for i in range(n):
            ids = self.prompt_ids(questions[i], completions[i], str(answers[i]))
            if len(ids) > limit:
                raise ValueError(
                    f"{where}: the judge prompt of sample {i} has {len(ids)} tokens, more than "
                    f"max_seq_len - max_generated_tokens = {limit}; raise max_seq_len or "
                    "shorten prompt_template")
            prompts.append(ids)
        replies = self.generate(prompts)
        self.last_replies = replies
        scores, failures = [], 0
        for i, reply in enumerate(replies):
            value = self.parse(reply)
            if value is None:
                failures += 1
                if self.on_parse_failure == "error":
                    self.last_parse_failures = failures
                    self.parse_failures += failures
                    quoted = reply if len(reply) <= _QUOTE else reply[:_QUOTE] + "..."
                    raise ValueError(
                        f"{where}: the judge's reply to sample {i} of this batch has no score "
                        f"for parser {self.parser_spec!r}"
                        + (f" in score_range {list(self.score_range)}" if self.score_range else "")
                        + f": {quoted!r}. Set on_parse_failure to a score (e.g. 0.0) to score "
                        "such replies, or adjust the parser or prompt_template")
                value = float(self.on_parse_failure)
            scores.append(value)
        self.last_parse_failures = failures
        self.parse_failures += failures
        return scores
