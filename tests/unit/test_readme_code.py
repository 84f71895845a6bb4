"""Every fenced code block of README.md and of the manual (docs/*.md) runs, or says why not.

A block runs unless the line right before its opening fence is one of these HTML comments
(invisible on the rendered page):

- ``<!-- illustrative -->``: not run -- it needs real data, a GPU, several hosts or minutes, or
  it is program output or a fragment. It is still checked: a Python block must compile, and
  every ``python -m mpitrain ...`` command line of a shell block (``MPITRAIN_*=...`` before it
  included) must parse with the CLI's own parser and validation, so a renamed or removed flag
  fails here too.
- ``<!-- ranks N -->``: a Python block, run as a script under ``mpiexec -n N``.
- ``<!-- runs in tests/PATH -->``: that test runs it (the file must exist and read the page).

Any other ```python block runs as a script with this interpreter, on one rank (mpitrain works
at N = 1 without mpiexec); a ```bash block runs under ``bash -euo pipefail`` with this
interpreter's folder (the venv's bin: python, mpirun, mpiexec) first on PATH. A page's blocks
run in order in one fresh folder, so a block may use a file the one before it wrote; each has
BLOCK_TIMEOUT seconds. A block of any other language (text, program output) must be marked.
A failing block fails the test with the page, its line and its output.

Not checked: the records, docs/benchmarks.md (measured runs with the commands of their day),
docs/results.md (written by `make bench`) and docs/architecture.md (file trees and diagrams).

Also here, as cheap: every page of the manual is linked from docs/README.md, every relative
link of the front page and the manual points to a file (and heading) that exists, and the CLI
page names every flag of ``python -m mpitrain``.
"""
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.launch import MPIEXEC, child_env

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
RECORDS = {"benchmarks.md", "architecture.md", "results.md"}
PAGES = [REPO / "README.md"] + sorted(p for p in DOCS.glob("*.md") if p.name not in RECORDS)
BLOCK_TIMEOUT = 60
RUNNABLE = {"python", "bash", "sh"}

FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)(?:[ \t]+(?P<tag>\S+))?\s*$")
MARK = re.compile(r"^\s*<!--\s*(?:(?P<illustrative>illustrative)|ranks (?P<ranks>\d+)|"
                  r"runs in (?P<test>\S+))\s*-->\s*$")


@dataclass
class Block:
    page: Path
    line: int               # the opening fence's line, 1-based
    lang: str
    code: str
    illustrative: bool = False
    ranks: int = 0          # 0: not under mpiexec
    test: str = ""          # "runs in" this test file

    def __str__(self):
        return f"{page_id(self.page)}:{self.line} ({self.lang or 'no language'})"


def blocks(page):
    """The fenced blocks of ``page``, with the marker on the line before each."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent = m["indent"]
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        code = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip()
                         for line in lines[i + 1:end]) + "\n"
        block = Block(page, i + 1, m["lang"], code)
        mark = MARK.match(lines[i - 1]) if i else None
        if mark:
            block.illustrative = bool(mark["illustrative"])
            block.ranks = int(mark["ranks"] or 0)
            block.test = mark["test"] or ""
        found.append(block)
        i = end + 1
    return found


def to_run(page):
    return [b for b in blocks(page) if not (b.illustrative or b.test)]


def page_id(page):
    return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else page.name


# --- static checks: every block is runnable or marked, and marked ones still make sense -------

@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_block_runs_or_is_marked(page):
    problems = [f"{b}: mark it <!-- illustrative --> or make it a python or bash block"
                for b in to_run(page) if b.lang not in RUNNABLE]
    problems += [f"{b}: <!-- ranks N --> is for python blocks" for b in blocks(page)
                 if b.ranks and b.lang != "python"]
    assert not problems, "\n".join(problems)


def mpitrain_commands(code):
    """(environ, argv) of every ``python -m mpitrain`` command line in a shell block."""
    joined = re.sub(r"\\\n", " ", code)
    for line in joined.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        words = [w.strip("[]") for w in lexer]
        for i in range(len(words) - 1):
            if words[i] == "-m" and words[i + 1] == "mpitrain":
                argv = []
                for w in words[i + 2:]:
                    if w in ("...", "|", "||", "&&", ";", ">", "2>", "&") or w.startswith(">"):
                        break
                    argv.append(w)
                start = 0
                environ = {}
                while start < i and re.fullmatch(r"MPITRAIN_\w+=.*", words[start]):
                    key, value = words[start].split("=", 1)
                    environ[key] = value
                    start += 1
                yield environ, argv


def check_mpitrain_flags(block):
    """Problems of the block's ``python -m mpitrain`` lines: what the CLI's parser refuses."""
    from mpitrain.runtime.errors import UsageError
    from mpitrain.train import cli
    problems = []
    for environ, argv in mpitrain_commands(block.code):
        if "--help" in argv or "-h" in argv:
            continue
        try:
            cli.parse(argv, environ)
        except UsageError as exc:
            problems.append(f"{block}: python -m mpitrain {' '.join(argv)}: {exc}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_illustrative_blocks_still_compile_and_parse(page):
    problems = []
    for b in blocks(page):
        if b.lang == "python" and b.illustrative:
            try:
                compile(b.code, str(b), "exec")
            except SyntaxError as exc:
                problems.append(f"{b}: {exc}")
        if b.lang in ("bash", "sh") and b.illustrative:
            problems += check_mpitrain_flags(b)
        if b.test:
            test = REPO / b.test
            if not test.is_file() or page.name not in test.read_text():
                problems.append(f"{b}: runs in {b.test}, which does not read {page.name}")
    assert not problems, "\n".join(problems)


# --- running them ---------------------------------------------------------------------------

def run_block(block, cwd, timeout=BLOCK_TIMEOUT):
    """The CompletedProcess of ``block`` run in ``cwd``."""
    bin_dir = str(Path(sys.executable).parent)
    env = child_env()
    env["PATH"] = bin_dir + ":" + env.get("PATH", "")
    env["MPIEXEC"] = MPIEXEC
    guard = ["timeout", "-k", "5", str(timeout)]
    if block.lang == "python":
        script = cwd / f"block_{block.line}.py"
        script.write_text(block.code)
        cmd = [sys.executable, script.name]
        if block.ranks:
            cmd = [MPIEXEC, "-n", str(block.ranks), *cmd]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", block.code]
    return subprocess.run(guard + cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout + 30)


def run_page(page, tmp_path):
    """Problems of running ``page``'s runnable blocks in order in one folder."""
    problems = []
    for b in to_run(page):
        p = run_block(b, tmp_path)
        if p.returncode != 0:
            problems.append(f"{b} exited {p.returncode}:\n{b.code}\n--- stdout\n"
                            f"{p.stdout[-2000:]}\n--- stderr\n{p.stderr[-3000:]}")
    return problems


@pytest.mark.parametrize("page", [p for p in PAGES if to_run(p)], ids=page_id)
def test_the_blocks_of_the_page_run(page, tmp_path):
    problems = run_page(page, tmp_path)
    assert not problems, "\n".join(problems)


def test_the_front_page_runs_its_three_quick_starts():
    runs = to_run(REPO / "README.md")
    assert [b.lang for b in runs].count("python") >= 2
    code = "".join(b.code for b in runs)
    for needed in ("python -m mpitrain", "mt.DistributedOptimizer", "mt.broadcast_parameters",
                   "import mpitrain.torch as hvd"):
        assert needed in code, needed


def test_a_broken_block_fails(tmp_path):
    """A block that uses a name mpitrain does not have fails its page, and so does an
    illustrative command with a flag the CLI does not have."""
    page = tmp_path / "page.md"
    page.write_text("```python\nimport mpitrain as mt\nmt.init()\nmt.allreduce_renamed(1)\n```\n"
                    "<!-- illustrative -->\n```bash\n"
                    "mpiexec -n 2 python -m mpitrain --epochs 2 \\\n    --batch-sise 32\n```\n")
    work = tmp_path / "work"
    work.mkdir()
    [problem] = run_page(page, work)
    assert "allreduce_renamed" in problem
    [illustrative] = [b for b in blocks(page) if b.illustrative]
    [flag] = check_mpitrain_flags(illustrative)
    assert "--batch-sise" in flag


# --- the manual's links ---------------------------------------------------------------------

def slug(heading):
    """The anchor a rendered page gives a heading (lower case, punctuation dropped, spaces to
    hyphens)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_every_page_of_the_manual_is_in_its_index():
    index = (DOCS / "README.md").read_text()
    missing = [p.name for p in DOCS.glob("*.md")
               if p.name != "README.md" and f"]({p.name})" not in index]
    assert not missing, f"not linked from docs/README.md: {missing}"
    assert "](docs/README.md)" in (REPO / "README.md").read_text()


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_point_to_what_exists(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{page_id(page)}: {target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{page_id(page)}: {target}: no such heading")
    assert not problems, "\n".join(problems)


def test_the_cli_page_names_every_flag():
    from mpitrain.train import cli
    page = (DOCS / "cli.md").read_text()
    flags = {o for a in cli.build_parser()._actions for o in a.option_strings
             if o.startswith("--") and o != "--help"}
    missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", page))
    assert not missing, f"docs/cli.md does not name {missing}"
