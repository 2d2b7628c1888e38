"""Checkers that keep README.md and docs/*.md true; each returns one message per problem found.

Used by tests/test_docs.py in pytest's process (no vLLM, no torch imported). Links: GitHub's slug rules
for ``#anchors``. CLI examples: ``lmi-cache ...`` lines of bash blocks parsed by the real click command
tree without running it. Benchmarks: scripts, flags and ``--configs`` names that exist. Series:
``lmi_cache_*`` names some module of lmi_cache/ declares. Paths: source files and folders named in code
spans exist in the tree. History: no prose narrates how the code changed (a guide says what is).
"""
from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
SHELL_BLOCKS = {"bash", "sh", "shell"}
SHELL_OPERATORS = {"&&", "||", "|", ";", "&"}


def doc_files(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def split_markdown(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str, str]]]:
    """(prose lines, code lines) with 1-based line numbers; a code line carries its block's language."""
    prose: list[tuple[int, str]] = []
    code: list[tuple[int, str, str]] = []
    fence: str | None = None
    lang = ""
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence, lang = match.group(1), match.group(2).lower()
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is not None:
            code.append((number, lang, line))
        else:
            prose.append((number, line))
    return prose, code


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower-cased, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"(\*\*|__|\*)", "", text)  # emphasis marks; a word's own underscores stay
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose:
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")  # GitHub numbers repeated headings
    return found


def broken_links(path: Path) -> list[str]:
    """One message per relative link of ``path`` whose file or ``#anchor`` does not exist."""
    problems: list[str] = []
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    for number, line in prose:
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            where = f"{path.name}:{number}: {target}"
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{where}: no such file {dest}")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                problems.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    return problems


def shell_commands(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(line, words) of every simple command in the file's bash blocks, continuation lines joined."""
    _, code = split_markdown(path.read_text(encoding="utf-8"))
    pending, start = "", 0
    for number, lang, line in code:
        if lang not in SHELL_BLOCKS:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical, pending = pending + line, ""
        lexer = shlex.shlex(logical, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        try:
            tokens = [*lexer, ";"]
        except ValueError:  # an open quote spanning lines (python -c "..."): plain words are enough here
            tokens = [*logical.split("#", 1)[0].split(), ";"]
        words: list[str] = []
        for token in tokens:
            if token in SHELL_OPERATORS:
                if words:
                    yield start, words
                words = []
            else:
                words.append(token)


def command_words(words: list[str], program: str) -> list[str] | None:
    """The arguments after ``program`` (a path ending in it), env assignments and redirects dropped."""
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    if not words or Path(words[0]).name != program and not words[0].endswith(f"/{program}"):
        return None
    args = words[1:]
    for i, word in enumerate(args):
        if re.match(r"^\d*[<>]", word):
            return args[:i]
    return args


def parse_cli(args: list[str]) -> None:
    """Parse ``lmi-cache ARGS`` against the real command tree down to the leaf command; run nothing."""
    from autoconfig.cli import main

    if not args or args[0].startswith("-"):
        try:
            main.make_context("lmi-cache", list(args))
        except click.exceptions.Exit as done:  # --version / --help end parsing early, successfully
            if done.exit_code:
                raise
        return
    command: click.Command = main
    ctx = click.Context(main, info_name="lmi-cache")
    while isinstance(command, click.Group):
        name, sub, args = command.resolve_command(ctx, args)
        assert sub is not None and name is not None
        command = sub
        ctx = sub.make_context(name, list(args), parent=ctx)


def bad_cli_examples(path: Path) -> list[str]:
    problems = []
    for number, words in shell_commands(path):
        args = command_words(words, "lmi-cache")
        if args is None:
            continue
        try:
            parse_cli(args)
        except click.ClickException as err:
            problems.append(f"{path.name}:{number}: lmi-cache {shlex.join(args)}: {err.format_message()}")
    return problems


def commands_in(path: Path) -> Iterator[tuple[int, list[str]]]:
    """Shell commands of bash blocks, and inline code spans of prose that read as commands."""
    yield from shell_commands(path)
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    for number, line in prose:
        for _, span in CODE_SPAN.findall(line):
            if "benchmarks/" in span:
                yield number, shlex.split(span)


def bad_benchmark_commands(path: Path, root: Path = REPO) -> list[str]:
    """Scripts that do not exist, flags they do not define, ``--configs`` names they do not know."""
    problems = []
    for number, words in commands_in(path):
        for i, word in enumerate(words):
            if not re.fullmatch(r"benchmarks/\w+\.py", word):
                continue
            script = root / word
            where = f"{path.name}:{number}: {word}"
            if not script.is_file():
                problems.append(f"{where}: no such script")
                continue
            source = script.read_text(encoding="utf-8")
            args = words[i + 1:]
            for j, arg in enumerate(args):
                flag = arg.split("=", 1)[0]
                if flag.startswith("--") and f'"{flag}"' not in source:
                    problems.append(f"{where}: the script defines no {flag}")
                if flag == "--configs" and j + 1 < len(args):
                    problems += [f"{where}: unknown config {name!r}" for name in args[j + 1].split(",")
                                 if f'"{name}"' not in source]
    return problems


def unknown_series(path: Path, root: Path = REPO) -> list[str]:
    """``lmi_cache_*`` series the docs name that no module of lmi_cache/ declares."""
    code = "\n".join(p.read_text(encoding="utf-8") for p in (root / "lmi_cache").rglob("*.py"))
    named = set(re.findall(r"\blmi_cache_[a-z0-9_]*[a-z0-9](?:_?\*)?", path.read_text(encoding="utf-8")))
    problems = []
    for name in sorted(named):
        if name.endswith("*"):  # a family, e.g. lmi_cache_blend_*: some series must start with it
            known = f'"{name.rstrip("*")}' in code
        else:
            known = f'"{re.sub(r"_(total|bucket|sum|count)$", "", name)}"' in code
        if not known:
            problems.append(f"{path.name}: {name}: no such series in lmi_cache/")
    return problems


def yaml_blocks(path: Path) -> Iterator[tuple[int, str]]:
    """(first line, text) of every yaml code block."""
    _, code = split_markdown(path.read_text(encoding="utf-8"))
    block: list[str] = []
    start = previous = 0
    for number, lang, line in [*code, (0, "", "")]:
        if block and (lang != "yaml" or number != previous + 1):  # a block ends where its lines stop
            yield start, "\n".join(block)
            block = []
        if lang == "yaml":
            start = start if block else number
            block.append(line)
        previous = number


def bad_yaml_examples(path: Path) -> list[str]:
    """YAML blocks that do not parse; LMCache configurations among them that lmi-cache's loader refuses."""
    import yaml

    from lmi_cache.config.cache_config import config_from_dict
    from lmi_cache.errors import UserError

    problems = []
    for number, text in yaml_blocks(path):
        where = f"{path.name}:{number}"
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            problems.append(f"{where}: not YAML: {' '.join(str(err).split())}")
            continue
        if isinstance(data, dict) and "groups" in data:  # Prometheus alert rules, not an LMCache file
            continue
        try:
            config_from_dict(data, where)
        except UserError as err:
            problems.append(f"{where}: {err}")
    return problems


# A code span that names a file of the tree: a relative path of word characters with a source ending, or a
# folder written with a trailing slash. Paths the user chooses (/opt/ml/model, s3://..., globs) are not it.
SOURCE_PATH = re.compile(r"^(?:[\w.-]+/)*[\w.-]+(?:\.(?:py|cpp|cu|h|toml|json|sh)|/)$")
# Guides name modules relative to the package that holds them (``tiers/cpu_tier.py``, ``vllm_connector/``).
PATH_BASES = ("", "lmi_cache", "autoconfig")


def missing_source_paths(path: Path, root: Path = REPO) -> list[str]:
    """Code spans of ``path``'s prose that name a file or folder of the tree which does not exist."""
    problems: list[str] = []
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    for number, line in prose:
        for _, span in CODE_SPAN.findall(line):
            name = span.strip()
            if "/" not in name.rstrip("/") or not SOURCE_PATH.match(name):  # one word: a user's folder name
                continue
            if not any((root / base / name).exists() for base in PATH_BASES):
                problems.append(f"{path.name}:{number}: {name}: no such file or folder in the tree")
    return problems


def readme_too_long(path: Path, limit: int = README_MAX_LINES) -> list[str]:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    return [f"{path.name}: {lines} lines, more than {limit}: move detail into docs/"] if lines > limit else []


# Phrases that narrate how the code changed; a guide says what the code does and how a figure was measured.
HISTORY = re.compile(r"\b(?:current code|earlier versions?|(?:before|since) this change|the code before|since then"
                     r"|used to be)\b|\(was\b", re.IGNORECASE)


def code_history(path: Path) -> list[str]:
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    return [f"{path.name}:{number}: {match.group(0)!r}: say what is, not how it changed"
            for number, line in prose for match in HISTORY.finditer(line)]
