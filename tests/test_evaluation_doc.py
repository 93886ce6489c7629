"""docs/evaluation.md's example runs as written and prints what the page shows (issue 39): the bash block after the
marker is run in an empty folder with ``maskkv`` on the PATH, and its output is compared with the block after it
(tokens/s and the prefill time are the machine's and are left out)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from maskkv_cli.evaluation import harness_available

DOC = Path(__file__).resolve().parent.parent / "docs" / "evaluation.md"
MARKER = "<!-- the example: tests/test_evaluation_doc.py runs the next block and checks the one after it -->"
TIMING = re.compile(r", [\d.]+ tokens/s, mean prefill [\d.]+ s$")


def example() -> tuple[str, list[str]]:
    """(the commands, the lines the page says they print)."""
    text = DOC.read_text(encoding="utf-8")
    after = text[text.index(MARKER) + len(MARKER):]
    blocks = re.findall(r"```[a-z]*\n(.*?)```", after, re.S)
    return blocks[0], blocks[1].splitlines()


def test_the_page_names_its_example_and_it_makes_its_own_task_file() -> None:
    commands, shown = example()
    assert commands.startswith("maskkv bench tasks needles.jsonl") and "cat > needles.yaml <<'EOF'" in commands
    assert shown[0].startswith("wrote 8 tasks") and shown[-1].startswith("|needles|")


@pytest.mark.skipif(not harness_available(), reason="needs the eval extra: pip install -e '.[eval]'")
def test_the_example_prints_what_the_page_shows(tmp_path: Path) -> None:
    commands, shown = example()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "maskkv"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m maskkv_cli "$@"\n')
    shim.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", "-e", "-c", commands], cwd=work, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = [line.rstrip() for line in done.stderr.replace("\r", "\n").splitlines()
               if line.startswith(("wrote ", "maskkv needles:"))] + done.stdout.strip().splitlines()
    assert [TIMING.sub("", line) for line in printed] == [TIMING.sub("", line) for line in shown]
