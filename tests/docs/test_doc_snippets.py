"""Run the code blocks of the documentation that are marked as runnable.

Convention (in ``docs/*.md``): an HTML comment on the line right before a fenced block marks it.

* ``<!-- test -->``: run the block. ``python`` blocks of one page run in order in one namespace;
  ``bash`` blocks run with ``bash -e``, except blocks made only of ``tune-grpo ...`` commands
  (``! tune-grpo ...``: expected to fail), which call the ``tune-grpo`` entry point in-process
  (the same ``main(argv)`` the console script calls, without a new interpreter per command).
* ``<!-- test: slow -->``: as above, for blocks that train or evaluate a tiny model on CPU
  (the page's test is then marked slow).
* ``<!-- test: file=NAME -->``: write the block's text to ``NAME`` in the working directory
  (a YAML config that a later block uses).

Blocks without a marker are not run: they need a GPU, a download, or are fragments. All pages
run in one working directory per session; pages that read the tiny run that ``metrics.md``
makes (``tiny_run/``) declare it in :data:`NEEDS`.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
MARKER = re.compile(r"^<!--\s*test(?::\s*(?P<opts>[^>]*?))?\s*-->\s*$")
FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)")
OPTIONS = {"slow", "file"}
#: Pages maintained elsewhere whose ``python`` blocks are all runnable (run without markers).
UNMARKED_RUNNABLE = {"rewards.md": ("python",)}
#: Pages whose blocks use what another page's blocks made.
NEEDS = {"howto_resume.md": ["metrics.md"], "howto_eval.md": ["metrics.md"]}


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    options: dict[str, str]


def _compiles(code: str) -> bool:
    try:
        compile(code, "<doc>", "exec")
    except SyntaxError:
        return False
    return True


def extract_blocks(path: Path) -> list[Block]:
    """The runnable blocks of one page, in order."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    unmarked_langs = UNMARKED_RUNNABLE.get(path.name, ())
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group("fence"), m.group("lang")
        end = i + 1
        while end < len(lines) and not lines[end].startswith(fence):
            end += 1
        code = "\n".join(lines[i + 1 : end]) + "\n"
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        if not marker and lang in unmarked_langs and not _compiles(code):
            marker = None  # a signature or other pseudo-code on a page we do not mark
        elif marker or lang in unmarked_langs:
            options = {}
            for item in (marker.group("opts") or "").split() if marker else []:
                key, _, value = item.partition("=")
                if key not in OPTIONS:
                    raise ValueError(f"{path.name}:{i}: unknown test marker option {key!r}")
                options[key] = value
            blocks.append(Block(path.name, i + 1, lang, code, options))
        i = end + 1
    return blocks


def _pages() -> list[str]:
    return sorted(p.name for p in DOCS.glob("*.md") if extract_blocks(p))


def _is_slow(page: str) -> bool:
    pages = [page, *NEEDS.get(page, [])]
    return any("slow" in b.options for p in pages for b in extract_blocks(DOCS / p))


def _commands(code: str) -> list[str]:
    """Shell lines with continuations joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [ln.strip() for ln in joined.splitlines()
            if ln.strip() and not ln.strip().startswith("#")]


def _run_tune_grpo(command: str) -> None:
    from torchtune_grpo.cli.main import main

    expect_failure = command.startswith("!")
    argv = shlex.split(command.lstrip("! "), comments=True)[1:]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    failed = code != 0
    assert failed == expect_failure, (
        f"`{command}` exited {code}\nstdout:\n{out.getvalue()}\nstderr:\n{err.getvalue()}")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "2")
    env["MPLBACKEND"] = "Agg"
    env["PYTHONPATH"] = os.pathsep.join([".", env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_block(block: Block, cwd: Path, namespace: dict) -> None:
    where = f"{block.page}:{block.line}"
    if "file" in block.options:
        (cwd / block.options["file"]).write_text(block.code)
    elif block.lang == "python":
        old = Path.cwd()
        os.chdir(cwd)
        try:
            exec(compile(block.code, where, "exec"), namespace)  # noqa: S102 - our own docs
        finally:
            os.chdir(old)
    elif block.lang in ("bash", "sh", "shell", "console"):
        commands = _commands(block.code)
        if commands and all(re.match(r"^(! )?tune-grpo\s", c) for c in commands):
            old = Path.cwd()
            os.chdir(cwd)
            try:
                for command in commands:
                    _run_tune_grpo(command)
            finally:
                os.chdir(old)
            return
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], cwd=cwd,
                              env=_env(), capture_output=True, text=True, timeout=600,
                              check=False)
        assert proc.returncode == 0, (
            f"{where} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    else:
        raise ValueError(f"{where}: cannot run a {block.lang!r} block")


@pytest.fixture(scope="module")
def doc_workdir(tmp_path_factory):
    return {"dir": tmp_path_factory.mktemp("doc_snippets"), "done": set()}


def _run_page(page: str, state: dict) -> None:
    if page in state["done"]:
        return
    for dependency in NEEDS.get(page, []):
        _run_page(dependency, state)
    namespace: dict = {"__name__": "__doc_snippet__"}
    for block in extract_blocks(DOCS / page):
        run_block(block, state["dir"], namespace)
    state["done"].add(page)


@pytest.mark.parametrize(
    "page", [pytest.param(p, marks=[pytest.mark.slow] if _is_slow(p) else []) for p in _pages()])
def test_page_snippets_run(page, doc_workdir, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    if page == "metrics.md":
        pytest.importorskip("matplotlib")
    _run_page(page, doc_workdir)


def _documented_metric_patterns() -> list[re.Pattern]:
    """Regexes of the metric names in the tables of metrics.md (``<name>``, ``k`` as wildcards)."""
    patterns = []
    for line in (DOCS / "metrics.md").read_text().splitlines():
        m = re.match(r"^\| `([^`]+)` \|", line)
        if m:
            name = re.escape(m.group(1)).replace(re.escape("<name>"), r"[\w.-]+")
            name = name.replace("@k", r"@\d+")
            patterns.append(re.compile(f"^{name}$"))
    return patterns


@pytest.mark.slow
def test_every_logged_metric_is_documented(doc_workdir):
    """The tiny run of metrics.md logs only names that metrics.md explains."""
    from torchtune_grpo.training.metrics import read_disk_log

    _run_page("metrics.md", doc_workdir)
    logged = {k for row in read_disk_log(doc_workdir["dir"] / "tiny_run" / "logs") for k in row}
    logged.discard("step")
    patterns = _documented_metric_patterns()
    undocumented = sorted(k for k in logged if not any(p.match(k) for p in patterns))
    assert not undocumented, f"metrics logged but not described in docs/metrics.md: {undocumented}"


def test_markers_are_well_formed_and_used():
    """Every marker is followed by a fenced block, and the pages we write have runnable blocks."""
    for path in DOCS.glob("*.md"):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if MARKER.match(line):
                nxt = lines[i + 1] if i + 1 < len(lines) else ""
                assert FENCE.match(nxt), f"{path.name}:{i + 1}: marker not followed by a code fence"
        extract_blocks(path)  # raises on unknown options
    for page in ("install.md", "metrics.md", "tutorial_gsm8k_8gpu.md", "howto_resume.md",
                 "howto_eval.md", "config_reference.md", "design.md"):
        assert extract_blocks(DOCS / page), f"{page} has no runnable block"
