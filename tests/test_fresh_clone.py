"""A fresh clone has everything the project names: no file points outside the repository, and the
benches' default inputs (the Mooncake trace) ship in it, with their license."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from bench import elastic, trace_replay

ROOT = Path(__file__).resolve().parents[1]
# What a path outside the checkout looks like in our sources: the folder above the repository, a sibling
# `shared/` tree (design notes and data that lived beside the checkout once), an absolute workspace path.
OUTSIDE = re.compile(r"ROOT\.parent\b|\.\./shared/|/work/|shared/design/|shared/data/|parents\[[3-9]\]")
TEXT = (".py", ".md", ".yaml", ".yml", ".tpl", ".txt", ".toml", ".cfg", ".json", ".sh")


def _project_files() -> list[Path]:
    """Every file a commit of this checkout would hold (tracked, or new and not ignored)."""
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    return [ROOT / n for n in names if (ROOT / n).is_file()]


def test_nothing_points_outside_the_repository():
    files = [f for f in _project_files() if f.suffix in TEXT or f.name in ("Makefile", "Dockerfile")]
    assert len(files) > 100
    hits = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}" for f in files if f.stat().st_size < 2_000_000
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert not [h for h in hits if not h.startswith("tests/test_fresh_clone.py:")], hits


def test_the_benches_default_trace_ships_with_its_license():
    assert trace_replay.TRACE.is_relative_to(ROOT) and trace_replay.TRACE.is_file()
    assert elastic.TRACE is trace_replay.TRACE  # bench/elastic.py --load-step reads the same file
    assert trace_replay.TRACE in _project_files()
    here = trace_replay.TRACE.parent
    assert "Apache License" in (here / "LICENSE-APACHE").read_text() and (here / "README.md").is_file()
    lines = trace_replay.TRACE.read_text().splitlines()
    assert len(lines) == 12031 and set(json.loads(lines[0])) == {"timestamp", "input_length", "output_length",
                                                                  "hash_ids"}
    excerpt = (ROOT / "tests" / "data" / "mooncake_conversation_first_2min.jsonl").read_text().splitlines()
    assert lines[:len(excerpt)] == excerpt  # the tests' excerpt is the trace's first two minutes


def test_a_missing_trace_is_named_with_where_to_get_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        trace_replay.main(["--trace", str(tmp_path / "nope.jsonl")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "nope.jsonl: no such file" in err and "bench/data/mooncake-fast25" in err and "Mooncake" in err
