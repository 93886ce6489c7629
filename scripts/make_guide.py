"""Regenerate docs/guide.md: run every command for real and paste its output (COLUMNS=100).

    .venv/bin/python scripts/make_guide.py

Uses a private MASKKV_HOME and MASKKV_CONFIG under a temp folder so the user's store is untouched.
"""

from __future__ import annotations

import os
import random
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = str(Path(sys.executable).parent / "maskkv")


def run(cmd: str, env: dict[str, str], cwd: Path) -> str:
    args = shlex.split(cmd)
    args[0] = BIN if args[0] == "maskkv" else args[0]
    out = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True)
    text = (out.stderr + out.stdout).rstrip().replace(str(cwd) + "/", "").replace(str(cwd), ".")
    if out.returncode:
        text += f"\n[exit code {out.returncode}]"
    return text


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="maskkv-guide-"))
    env = dict(os.environ, MASKKV_HOME=str(tmp / "home"), MASKKV_CONFIG=str(tmp / "config.toml"), COLUMNS="100",
               OMP_NUM_THREADS="1", TERM="dumb", PATH=f"{Path(BIN).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("MASKKV_MODEL", None)
    sys.path.insert(0, str(ROOT / "tests"))
    from pdfs import BODY, bomb_stream, font_pdf, long_pdf_pages, make_pdf, raw_pdf  # the tests' PDF builders

    (tmp / "harbour.pdf").write_bytes(make_pdf(BODY))
    # a 36-page report (text the embedded model never saw) with one fact on page 23, longer than the window
    (tmp / "report.pdf").write_bytes(make_pdf(long_pdf_pages(36, fact="The special magic number for harbor is "
                                                              "4821.", fact_page=23)))
    (tmp / "questions.txt").write_text("What is the special magic number for harbor?\nWho wrote this report?\n")
    from maskkv_cli.tasks.synthetic import absent_key_twin, generate_tasks

    task = generate_tasks("niah_single", 1, 350, seed=7)[0]
    (tmp / "notes.txt").write_text(task.context)
    (tmp / "scan.pdf").write_bytes(make_pdf([None, None]))
    papers = tmp / "papers"  # a folder of good, damaged and unsupported files for `maskkv ingest papers`
    (papers / "2024").mkdir(parents=True)
    (papers / "harbour.pdf").write_bytes(make_pdf(BODY))
    (papers / "lighthouse.pdf").write_bytes(make_pdf([BODY[2], ["He never sends them."]]))
    (papers / "2024" / "minutes.pdf").write_bytes(make_pdf([["Minutes: the budget was approved."]] * 3))
    (papers / "2024" / "broken.pdf").write_bytes(make_pdf(BODY)[:200])
    (papers / "2024" / "bomb.pdf").write_bytes(raw_pdf([bomb_stream(80_000_000)]))
    lines = [[("ok", "The harbour master keeps the tide tables.")]] * 3
    cut = font_pdf([lines] * 4)  # a download stopped before the fonts at the end of the file
    (papers / "2024" / "no-fonts.pdf").write_bytes(cut[: cut.index(b"/Type /Font") - 20])
    (papers / "reading-list.txt").write_text("Read the harbour report before Thursday.\n")
    (papers / "slides.pptx").write_bytes(b"PK\x03\x04 not a format maskkv reads")
    # `maskkv pull` runs against the tests' local Hub endpoint serving the embedded model (no network needed)
    from hubserver import FakeHub

    from maskkv_cli.models.catalog import shipped_model

    hub = FakeHub({"maskkv-demo/tiny-llada": shipped_model()}, lifetime=3600).__enter__()
    # a tiny random DiffusionGemma as transformers' save_pretrained writes it (the tests' folder)
    from dgemma_folder import build_folder

    build_folder(tmp / "tiny-dgemma")
    env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp / "hf"))
    env.pop("HF_TOKEN", None)
    template = (ROOT / "docs" / "guide.template.md").read_text()
    absent = absent_key_twin(task, random.Random(7)).meta["key"]  # a key with no needle in notes.txt
    template = template.replace("OTHERKEY", absent).replace("KEY", task.meta["key"]).replace("ANSWER", task.answers[0])
    parts = template.split("```run\n")
    out = [parts[0]]
    for part in parts[1:]:
        cmd, rest = part.split("\n```", 1)
        cmd = cmd.strip()
        text = run(cmd.replace("http://127.0.0.1:PORT", hub.endpoint), env, tmp).replace(hub.endpoint,
                                                                                         "http://127.0.0.1:PORT")
        out.append("```console\n$ " + cmd + "\n" + text + "\n```" + rest)
    hub.close()
    (ROOT / "docs" / "guide.md").write_text("".join(out))
    print(f"wrote {ROOT / 'docs' / 'guide.md'}")


if __name__ == "__main__":
    main()
