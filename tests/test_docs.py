"""The README and the guides in docs/ stay true: links resolve, CLI examples parse, the README stays short.

Runs in pytest's process only (no vLLM, no torch). Every relative link in README.md and docs/*.md must
point to a file that exists, and a ``#anchor`` to a heading of that file under GitHub's slug rules.
Every ``lmi-cache ...`` line of a bash code block must parse against the real click command tree
(options, types, required options), without running the command. Every ``benchmarks/*.py`` command must
name a script that exists and flags it defines, and every ``lmi_cache_*`` series named must be one the
code writes, and every source file or folder named in a code span (``tiers/cpu_tier.py``) must exist.
Each checker is also run on a broken copy in a temporary folder, to show it can fail.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs_checks import (
    README_MAX_LINES,
    REPO,
    bad_benchmark_commands,
    bad_cli_examples,
    bad_yaml_examples,
    broken_links,
    code_history,
    doc_files,
    missing_source_paths,
    readme_too_long,
    unknown_series,
)

DOCS = [pytest.param(p, id=str(p.relative_to(REPO))) for p in doc_files()]


def test_docs_index_exists() -> None:
    assert (REPO / "docs" / "README.md").is_file() and len(DOCS) > 5


# What each guide must hold: relative links resolve, `lmi-cache` examples parse, benchmark commands name
# real scripts, flags and configs, named series exist, YAML examples load, named source files exist.
CHECKS = {"links": broken_links, "cli": bad_cli_examples, "benchmarks": bad_benchmark_commands,
          "series": unknown_series, "yaml": bad_yaml_examples, "paths": missing_source_paths,
          "history": code_history}


@pytest.mark.parametrize("path", DOCS)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_docs_hold(check: str, path: Path) -> None:
    assert CHECKS[check](path) == []


def test_readme_is_a_front_page() -> None:
    assert readme_too_long(REPO / "README.md") == []


def test_ci_runs_the_readmes_test_command() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    command = next(line.split("&& ", 1)[1] for line in readme.splitlines()
                   if line.startswith("scripts/setup.sh && ") and " pytest " in line)
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    assert command in ci, f".ci/run must run the README's test command: {command}"


# Each checker against a broken copy: the tests above can fail.

def _write(root: Path, name: str, text: str) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_link_checker_finds_missing_files_and_anchors(tmp_path: Path) -> None:
    _write(tmp_path, "docs/guide.md", "# A guide\n\n## The `plan` command: sizes\n\n## Repeated\n## Repeated\n")
    good = _write(tmp_path, "README.md", "[g](docs/guide.md#the-plan-command-sizes) [r](docs/guide.md#repeated-1)\n"
                  "[s](#top) [web](https://example.com/x.md)\n\n# Top\n```bash\n[not a link](nowhere.md)\n```\n")
    assert broken_links(good) == []
    bad = _write(tmp_path, "bad.md", "[a](docs/missing.md) [b](docs/guide.md#no-such-heading) [c](#nope)\n")
    problems = broken_links(bad)
    assert len(problems) == 3
    assert "no such file" in problems[0] and "#no-such-heading" in problems[1] and "#nope" in problems[2]


def test_cli_checker_finds_examples_that_do_not_parse(tmp_path: Path) -> None:
    text = ("```bash\n"
            "lmi-cache plan --model m --tp 2 && .venv/bin/lmi-cache probe --json > snap.json\n"
            "X=1 lmi-cache sagemaker deploy --name n --image i --instance-type t \\\n    --role r --dry-run\n"
            "lmi-cache plan --model m --tp two            # a bad value\n"
            "lmi-cache sagemaker deploy --name n --image i  # --instance-type and --role are required\n"
            "lmi-cache serve --dry-runn                   # a mistyped flag\n"
            "lmi-cache sagemaker undeploy --name n        # no such command\n"
            "```\n```text\nlmi-cache not checked in a text block\n```\n")
    problems = bad_cli_examples(_write(tmp_path, "cli.md", text))
    assert [p.split(":")[1] for p in problems] == ["5", "6", "7", "8"], problems


def test_benchmark_checker_finds_unknown_scripts_flags_and_configs(tmp_path: Path) -> None:
    _write(tmp_path, "benchmarks/bench_x.py", 'CONFIGS = ("a", "b")\nadd_argument("--runs")\nadd_argument("--configs")\n')
    doc = _write(tmp_path, "b.md", "`python benchmarks/bench_x.py --runs 2 --configs a,b`\n"
                 "```bash\npython benchmarks/bench_y.py\npython benchmarks/bench_x.py --walks 3 --configs a,c\n```\n")
    problems = bad_benchmark_commands(doc, root=tmp_path)
    assert len(problems) == 3 and "no such script" in problems[0], problems
    assert "--walks" in problems[1] and "'c'" in problems[2]


def test_series_checker_finds_unknown_series(tmp_path: Path) -> None:
    _write(tmp_path, "lmi_cache/metrics/series.py", 'Counter("lmi_cache_hits", "")\nCounter("lmi_cache_blend_jobs", "")\n')
    doc = _write(tmp_path, "m.md", "`lmi_cache_hits_total`, `lmi_cache_blend_*`, `lmi_cache_misses_total`, "
                 "`lmi_cache_front_*`\n")
    assert unknown_series(doc, root=tmp_path) == ["m.md: lmi_cache_front_*: no such series in lmi_cache/",
                                                  "m.md: lmi_cache_misses_total: no such series in lmi_cache/"]


def test_readme_length_check_fails_past_the_limit(tmp_path: Path) -> None:
    assert readme_too_long(_write(tmp_path, "README.md", "line\n" * README_MAX_LINES)) == []
    assert readme_too_long(_write(tmp_path, "README.md", "line\n" * (README_MAX_LINES + 1))) != []


def test_yaml_checker_finds_bad_files(tmp_path: Path) -> None:
    doc = _write(tmp_path, "y.md", "```yaml\nchunk_size: 256\nextra_config:\n  remote_compression: off\n```\n"
                 "```yaml\ngroups: []\n```\n```yaml\nchunk_sise: 512\n```\n```yaml\na: [1\n```\n")
    problems = bad_yaml_examples(doc)
    assert len(problems) == 2 and "chunk_sise" in problems[0] and "not YAML" in problems[1], problems


def test_path_checker_finds_moved_files(tmp_path: Path) -> None:
    _write(tmp_path, "lmi_cache/tiers/cpu_tier.py", "")
    _write(tmp_path, "autoconfig/probe/__init__.py", "")
    doc = _write(tmp_path, "a.md", "`lmi_cache/tiers/cpu_tier.py`, `tiers/cpu_tier.py`, `probe/`, `adapters/`, "
                 "`/opt/ml/model/x.py`, `s3://b/p/`, `lmi_cache/metrics/series.py`, `tiers/disk_tier.py`\n"
                 "```bash\npython lmi_cache/gone.py\n```\n")
    assert missing_source_paths(doc, root=tmp_path) == [
        "a.md:1: lmi_cache/metrics/series.py: no such file or folder in the tree",
        "a.md:1: tiers/disk_tier.py: no such file or folder in the tree"]


def test_history_checker_finds_narration(tmp_path: Path) -> None:
    doc = _write(tmp_path, "h.md", "Measured with the current code.\nThe table (was: 15) grew.\n"
                 "Files of ranks that no longer exist stay.\n```bash\n# the code before this change\n```\n")
    problems = code_history(doc)
    assert [p.split(":")[1] for p in problems] == ["1", "2"], problems
