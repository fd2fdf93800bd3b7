"""``tune-grpo prepare-model``: write a packaged GGUF model as an HF folder
(:mod:`torchtune_grpo.models.packaged`), then say what to run with it: the shipped configs named
after the model, or, for a base model without a chat template, a plain-text prompt form."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from torchtune_grpo.config.loading import list_shipped_configs, resolve_config_path
from torchtune_grpo.errors import one_line
from torchtune_grpo.models import packaged

#: A plain-text prompt template (``chat: false``) as a command-line override value.
PLAIN_TEMPLATE_OVERRIDE = '{user: "Question: {question} Answer:", chat: false}'


def has_chat_template(folder: Path) -> bool:
    """Whether the converted folder has a chat template (``True`` when that cannot be read: the
    hint then stays the generic one)."""
    if (folder / "chat_template.jinja").is_file():
        return True
    try:
        return "chat_template" in json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return True


def next_commands(folder: Path, model: str) -> list[str]:
    """What to run with the folder: the shipped configs whose name contains ``model`` (their
    recipe read from the ``tune run ...`` line of their header), else the generic form; for a
    base model (no chat template) the arithmetic config with plain-text prompts."""
    commands = []
    try:
        key_name = model.replace("-", "_")  # gemma3-270m: grpo/gemma3_270m_arithmetic_cpu
        names = sorted((c for c in list_shipped_configs() if model and key_name in c.lower()),
                       key=lambda c: ("eval" in c, c))
        for name in names:
            text = resolve_config_path(name).read_text()
            match = re.search(rf"tune run (\S+) --config {re.escape(name)}\b", text)
            recipe = match.group(1) if match else (
                "grpo_eval" if "eval" in name else "grpo_full_finetune_distributed")
            key = "checkpoint_dir" if recipe == "grpo_eval" else "model_dir"
            commands.append(f"tune run {recipe} --config {name} {key}={folder}")
    except Exception:  # a hint must never fail the command
        commands = []
    if not commands and not has_chat_template(folder):
        plain = PLAIN_TEMPLATE_OVERRIDE
        return [f"tune run grpo_full_finetune_distributed --config grpo/smollm2_arithmetic_cpu "
                f"model_dir={folder} output_dir=/tmp/tune_grpo_{folder.name}/run "
                f"'dataset.template={plain}' 'eval_dataset.template={plain}'"]
    return commands or [
        f"tune run grpo_full_finetune_single_device --config my_config.yaml model_dir={folder}"
        "    # model: {_component_: torchtune_grpo.models.hf_model, model_dir: ${model_dir}}"]


def main(argv: list[str] | None = None) -> int:
    """``tune-grpo prepare-model``: see the module docstring.

    Args:
        argv: the arguments after ``prepare-model``.

    Returns:
        The exit status: 0, or 2 with the error on stderr (one line).
    """
    parser = argparse.ArgumentParser(prog="tune-grpo prepare-model",
                                     description=packaged.prepare_model.__doc__.split("\n")[0])
    parser.add_argument("name", nargs="?", default="smollm2",
                        help=f"packaged model: {', '.join(packaged.PACKAGED_MODELS)} "
                             "(default smollm2)")
    parser.add_argument("--output-dir", default=None,
                        help="folder to write (default /tmp/tune_grpo_models/<model>)")
    parser.add_argument("--gguf", default=None,
                        help="convert this .gguf file or .whl instead of the installed package")
    parser.add_argument("--overwrite", action="store_true",
                        help="convert again even if the folder holds a complete conversion")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        folder, written = packaged._prepare(args.name, args.output_dir, args.gguf, args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    if written:
        print(f"wrote {folder} ({time.perf_counter() - start:.1f} s)")
    else:
        print(f"{folder} already holds a complete conversion (--overwrite converts again)")
    terms = packaged.terms_of_use(args.name)
    if terms is not None:
        print(terms)
    model = args.name if args.name in packaged.PACKAGED_MODELS else (
        Path(args.gguf or args.name).name.split("-")[0].lower())
    for command in next_commands(folder, model):
        print(f"next: {command}")
    if not has_chat_template(folder):
        print("note: a base model has no chat template, so prompts must be plain text: "
              "`chat: false` in a dataset's `template` (grpo/gemma3_270m_arithmetic_cpu does; "
              "most shipped configs use the chat format)")
    return 0

