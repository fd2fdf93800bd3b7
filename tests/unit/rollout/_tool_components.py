"""Components the tool tests build by ``_component_`` path, and a scripted rollout engine.

``WordCount`` and ``Shouting`` stand for a user's own tools: nothing in the package knows them.
:class:`ScriptedGenerator` is a :class:`~torchtune_grpo.rollout.protocol.Generator` whose "model"
writes a fixed text per prompt, so the multi-turn loop can be tested on exact token layouts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from torchtune_grpo.algorithm.trajectory import Trajectory
from torchtune_grpo.rollout.protocol import GenerationRequest, Generator


class WordCount:
    """A user tool: the number of words of its argument."""

    def __init__(self, name: str = "words", prefix: str = "") -> None:
        self.name = name
        self.prefix = prefix

    def __call__(self, arguments: str) -> str:
        return f"{self.prefix}{len(arguments.split())}"


class Shouting:
    """A user tool that raises on empty input (the loop must turn that into text)."""

    name = "shout"

    def __call__(self, arguments: str) -> str:
        if not arguments:
            raise RuntimeError("nothing to shout")
        return arguments.upper()


def not_a_tool() -> int:
    """A component that builds something that is not a tool."""
    return 3


RESULT_SPAN = re.compile(r"<result>.*?</result>", re.DOTALL)


@dataclass
class ScriptedGenerator(Generator):
    """A rollout engine that "samples" a fixed script per prompt, turn after turn.

    The prompt's text (decoded) starts with one of ``scripts``' keys; what the row already
    wrote is the rest of its text minus the ``<result>...</result>`` spans the tool loop
    appended; the turn writes the script's continuation, then ``eot``. It honours
    ``stop_tokens`` (ending *after* the first one), ``max_generated_tokens`` and, like the native
    engine, decodes micro-batch by micro-batch, calling ``all_done`` after every step until
    every rank is done. The log-prob of the script's character ``c`` is ``-(c + 1) / 100``.

    Attributes:
        calls: one record per ``generate`` call (rows, ``max_generated_tokens``, micro-batches
            and decode steps taken, stop ids, seeds, bias).
    """

    tokenizer: object
    scripts: dict[str, str]
    eot_id: int
    calls: list[dict] = field(default_factory=list)

    def setup(self, context) -> None:
        pass

    def needs_policy_logprobs(self, *, top_k):
        return False

    def before_update(self) -> None:
        pass

    def sync_weights(self, model) -> None:
        pass

    def close(self) -> None:
        pass

    def _continuation(self, ids: list[int]) -> tuple[list[int], list[float]]:
        text = self.tokenizer.decode(ids)
        key = next(k for k in self.scripts if text.startswith(k))
        written = RESULT_SPAN.sub("", text[len(key):])
        script = self.scripts[key]
        assert script.startswith(written), (script, written)
        rest = script[len(written):]
        tokens = self.tokenizer.encode(rest, add_bos=False, add_eos=False) + [self.eot_id]
        start = len(written)
        return tokens, [-(start + c + 1) / 100 for c in range(len(tokens))]

    def generate(self, model, request: GenerationRequest) -> Trajectory:
        prompt_tokens, prompt_mask, group_size = (request.prompt_tokens, request.prompt_mask,
                                                  request.group_size)
        max_generated_tokens, stop_tokens, pad_id = (request.max_generated_tokens,
                                                     request.stop_tokens, request.pad_id)
        prompt_seeds, logit_bias = request.prompt_seeds, request.logit_bias
        forward_batch_size = request.rows_per_forward
        all_done = request.all_done or (lambda local: local)
        stops = set(stop_tokens.tolist())
        tokens = prompt_tokens.repeat_interleave(group_size, 0)
        mask = prompt_mask.repeat_interleave(group_size, 0)
        n = tokens.shape[0]
        wanted = []
        for row, m in zip(tokens, mask):
            ids, lps = self._continuation(row[m].tolist())
            cut = next((j + 1 for j, t in enumerate(ids) if t in stops), len(ids))
            cut = min(cut, max_generated_tokens)
            wanted.append((ids[:cut], lps[:cut]))
        steps_per_mb = []
        out_ids = torch.full((n, max_generated_tokens), pad_id, dtype=torch.long)
        out_lp = torch.zeros(n, max_generated_tokens)
        out_mask = torch.zeros(n, max_generated_tokens, dtype=torch.bool)
        stopped = torch.zeros(n, dtype=torch.bool)
        for start in range(0, n, forward_batch_size):
            rows = range(start, min(start + forward_batch_size, n))
            steps = 0
            for t in range(max_generated_tokens):
                for i in rows:
                    ids, lps = wanted[i]
                    if t < len(ids):
                        out_ids[i, t], out_lp[i, t], out_mask[i, t] = ids[t], lps[t], True
                        stopped[i] |= ids[t] in stops
                steps = t + 1
                local = all(t + 1 >= len(wanted[i][0]) for i in rows)
                if steps == max_generated_tokens or all_done(local):
                    break
            steps_per_mb.append(steps)
        width = max(steps_per_mb)
        self.calls.append(dict(rows=n, max_generated_tokens=max_generated_tokens,
                               lengths=mask.sum(1).tolist(),
                               steps=steps_per_mb, stops=sorted(stops),
                               seeds=None if prompt_seeds is None else prompt_seeds.tolist(),
                               bias_finite=None if logit_bias is None
                               else int(torch.isfinite(logit_bias).sum())))
        return Trajectory(tokens=torch.cat([tokens, out_ids[:, :width]], 1), prompt_mask=mask,
                          response_mask=out_mask[:, :width], logprobs=out_lp[:, :width],
                          stopped=stopped, pad_id=pad_id)
