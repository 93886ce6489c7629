"""``maskkv ingest`` over many files and folders: each file on its own, crash-safe, honest about limits."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from io import BytesIO
from pathlib import Path

import pytest
from pdfs import BODY, bomb_stream, make_pdf, raw_pdf, text_stream
from typer.testing import CliRunner

from maskkv_cli.cli import app
from maskkv_cli.documents import load_document, parse_document
from maskkv_cli.documents.ingest import Outcome, Tally, discover, ingest_all, ingest_one
from maskkv_cli.documents.store import DocumentStore
from maskkv_cli.errors import DocumentError, MaskKVError

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
LIMIT_WORDS = "exceeds a safety limit of the PDF reader"


def run(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def good_pdf(path: Path, tag: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(make_pdf([[f"This is the {tag} report."], *BODY[:2]]))
    return path


def bad_pdf(path: Path) -> Path:
    """A PDF cut after its header: nothing in it can be recovered."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(make_pdf(BODY)[:200])
    return path


def stored_sources() -> list[str]:
    return sorted(Path(e.source).name for e in DocumentStore().list())


# -- the command ---------------------------------------------------------------------------------------


def test_mixed_call_stores_every_good_file_and_names_the_bad_one(tmp_path: Path) -> None:
    files = [good_pdf(tmp_path / "good1.pdf", "first"), bad_pdf(tmp_path / "bad.pdf"),
             good_pdf(tmp_path / "good2.pdf", "second")]
    notes = tmp_path / "notes.txt"
    notes.write_text("The meeting moved to Thursday.\n")
    result = run("ingest", *files, notes)
    assert result.exit_code == 1, result.output
    assert stored_sources() == ["good1.pdf", "good2.pdf", "notes.txt"]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(tmp_path / "bad.pdf") in errors[0] and "damaged" in errors[0]
    assert "Traceback" not in result.output
    assert result.stdout.splitlines()[-1] == "3 stored, 1 failed"
    # a second call finds them in the store and still names the bad file
    again = run("ingest", *files, notes)
    assert again.exit_code == 1
    assert again.stdout.splitlines()[-1] == "3 already in the store, 1 failed"


def test_json_lists_every_input_also_when_some_fail(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    good_pdf(folder / "a.pdf", "first")
    bad_pdf(folder / "b.pdf")
    (folder / "c.md").write_text("# Title\n\nSome text.\n")
    (folder / "d.docx").write_bytes(b"PK\x03\x04 not a document we read")
    missing = tmp_path / "missing.pdf"
    result = run("ingest", folder, missing, "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)  # one JSON document, nothing else on stdout
    rows = {Path(r["source"]).name: r for r in data["documents"]}
    assert set(rows) == {"a.pdf", "b.pdf", "c.md", "d.docx", "missing.pdf"}
    assert {k: r["status"] for k, r in rows.items()} == {
        "a.pdf": "stored", "b.pdf": "failed", "c.md": "stored", "d.docx": "skipped", "missing.pdf": "failed"}
    a = rows["a.pdf"]
    assert len(a["sha256"]) == 64 and a["pages"] == 3 and a["chars"] > 0 and a["tokens"] > 0 and a["error"] is None
    assert "damaged" in rows["b.pdf"]["error"] and rows["b.pdf"]["sha256"] is None
    assert "not found" in rows["missing.pdf"]["error"]
    assert data["summary"] == {"stored": 2, "already": 0, "failed": 2, "skipped": 1}
    assert all(set(r) == set(a) for r in data["documents"])  # every row has the same keys
    again = json.loads(run("ingest", folder / "a.pdf", "--json").stdout)
    assert again["documents"][0]["status"] == "already" and again["documents"][0]["cached"] is True


def test_folder_with_a_subfolder_and_an_unsupported_file(tmp_path: Path) -> None:
    folder = tmp_path / "papers"
    good_pdf(folder / "top.pdf", "top")
    (folder / "sub" / "deeper").mkdir(parents=True)
    (folder / "sub" / "notes.md").write_text("# Notes\n\nThe budget is 64 entries.\n")
    (folder / "sub" / "deeper" / "log.txt").write_text("Day one: calm.\n")
    (folder / "sub" / "figure.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (folder / ".hidden.txt").write_text("a hidden file is left out\n")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD.txt").write_text("hidden folders are left out\n")
    result = run("ingest", folder)
    assert result.exit_code == 0, result.output
    assert stored_sources() == ["log.txt", "notes.md", "top.pdf"]
    assert "skipped 1 file in the folders that are not .pdf, .txt, .text, .md or .markdown" in result.stderr
    assert result.stdout.splitlines()[-1] == "3 stored, 1 skipped (not .pdf, .txt, .text, .md or .markdown)"
    quiet = run("ingest", folder, "--quiet")
    assert quiet.exit_code == 0 and "note:" not in quiet.stderr


def test_no_progress_bar_when_piped(tmp_path: Path) -> None:
    good_pdf(tmp_path / "a.pdf", "first")
    result = run("ingest", tmp_path)
    assert result.exit_code == 0
    assert "files/s" not in result.output and "\x1b[" not in result.output


def _run_on_a_terminal(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run ``maskkv ARGS`` with stdout and stderr on a pseudo-terminal; return (exit code, what it showed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "maskkv_cli", *args], stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, env=env, close_fds=True)
    os.close(slave)
    shown = bytearray()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closes when the process ends
                break
            if not chunk:
                break
            shown += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=30), shown.decode("utf-8", "replace")


def test_progress_bar_on_a_terminal_only(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    for i in range(3):
        good_pdf(folder / f"report{i}.pdf", f"number {i}")
    env = dict(os.environ, COLUMNS="160", TERM="xterm-256color")
    env.pop("NO_COLOR", None)
    code, shown = _run_on_a_terminal(["ingest", str(folder)], env)
    assert code == 0, shown
    assert "files/s" in shown and "pages" in shown and "report" in shown and "3/3" in shown
    assert "3 stored" in shown
    code, shown = _run_on_a_terminal(["ingest", str(folder), "--quiet"], env)
    assert code == 0 and "files/s" not in shown and "3 already in the store" in shown


# -- pypdf's safety limits --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bomb_pdf() -> bytes:
    """One page whose content stream inflates to 80 MB, past pypdf's 75 MB decompression limit."""
    return raw_pdf([bomb_stream(80_000_000)])


def test_crafted_pdfs_really_hit_pypdfs_limits(bomb_pdf: bytes) -> None:
    from pypdf import PdfReader
    from pypdf.errors import LimitReachedError

    with pytest.raises(LimitReachedError, match="decompress"):
        PdfReader(BytesIO(bomb_pdf)).pages[0].extract_text()
    declared = raw_pdf([(b"<< /Length 100000000 >>", b"BT /F1 12 Tf 72 700 Td (hi) Tj ET")])
    with pytest.raises(LimitReachedError, match="Declared stream length"):
        PdfReader(BytesIO(declared)).pages[0].extract_text()


def test_limit_errors_have_their_own_message(bomb_pdf: bytes) -> None:
    with pytest.raises(DocumentError) as inflate:
        parse_document(bomb_pdf, source="/x/bomb.pdf", kind="pdf")
    assert LIMIT_WORDS in str(inflate.value) and "decompression limit" in str(inflate.value)
    assert "damaged" not in str(inflate.value)
    declared = raw_pdf([(b"<< /Length 100000000 >>", b"BT /F1 12 Tf 72 700 Td (hi) Tj ET")])
    with pytest.raises(DocumentError) as length:
        parse_document(declared, source="/x/long.pdf", kind="pdf")
    assert LIMIT_WORDS in str(length.value) and "100,000,000 bytes" in str(length.value)
    assert "damaged" not in str(length.value)


def test_a_page_over_a_limit_is_skipped_with_a_note() -> None:
    data = raw_pdf([text_stream("The first page reads fine."),
                    (b"<< /Length 100000000 >>", b"BT /F1 12 Tf 72 700 Td (hi) Tj ET"),
                    text_stream("So does the third.")])
    doc = parse_document(data, source="/x/mixed.pdf", kind="pdf")
    assert [p.number for p in doc.pages] == [1, 3]
    assert len(doc.warnings) == 1 and "page 2 exceeds a safety limit of the PDF reader" in doc.warnings[0]


def test_a_damaged_pdf_is_still_called_damaged(tmp_path: Path) -> None:
    with pytest.raises(DocumentError, match="damaged") as err:
        load_document(bad_pdf(tmp_path / "cut.pdf"))
    assert LIMIT_WORDS not in str(err.value)


def test_cli_names_a_limit_and_goes_on(tmp_path: Path, bomb_pdf: bytes) -> None:
    (tmp_path / "bomb.pdf").write_bytes(bomb_pdf)
    good = good_pdf(tmp_path / "after.pdf", "after")
    result = run("ingest", tmp_path / "bomb.pdf", good)
    assert result.exit_code == 1
    assert f"error: {tmp_path / 'bomb.pdf'} {LIMIT_WORDS}" in result.stderr
    assert stored_sources() == ["after.pdf"]


# -- the core: one rule for every command that takes many documents ------------------------------------


def test_discover_order_dedup_and_skips(tmp_path: Path) -> None:
    good_pdf(tmp_path / "b" / "z.pdf", "z")
    (tmp_path / "b" / "a.txt").write_text("a\n")
    (tmp_path / "b" / "sub").mkdir()
    (tmp_path / "b" / "sub" / "m.MD").write_text("# m\n")
    (tmp_path / "b" / "x.csv").write_text("1,2\n")
    (tmp_path / "first.txt").write_text("first\n")
    found = discover([tmp_path / "first.txt", tmp_path / "b", tmp_path / "b" / "a.txt", tmp_path / "gone.pdf"])
    names = [p.relative_to(tmp_path).as_posix() for p in found.files]
    assert names == ["first.txt", "b/a.txt", "b/sub/m.MD", "b/z.pdf", "gone.pdf"]  # path order, each file once
    assert [p.name for p in found.skipped] == ["x.csv"]


@pytest.mark.filterwarnings("ignore::maskkv_cli.documents.tokens.TokenCountWarning")  # no tokenizer: an estimate
def test_ingest_all_yields_one_outcome_per_file_and_never_raises(tmp_path: Path) -> None:
    files = [good_pdf(tmp_path / "a.pdf", "a"), bad_pdf(tmp_path / "b.pdf"), tmp_path / "nope.txt",
             good_pdf(tmp_path / "c.pdf", "c")]
    started: list[Path] = []
    outcomes = list(ingest_all(DocumentStore(), files, on_start=started.append))
    assert started == files
    assert [o.path for o in outcomes] == files
    assert [o.status for o in outcomes] == ["stored", "failed", "failed", "stored"]
    assert all(o.error is None and o.document is not None and o.tokens for o in outcomes if o.ok)
    assert all(o.error and "\n" not in o.error for o in outcomes if not o.ok)


def test_unexpected_errors_are_one_file_failures_unless_debug(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import maskkv_cli.documents.store as store_module

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("parser bug\nsecond line")

    monkeypatch.setattr(store_module, "parse_document", broken)
    path = good_pdf(tmp_path / "a.pdf", "a")
    outcome = ingest_one(DocumentStore(), path)
    assert outcome.status == "failed" and outcome.error is not None
    assert outcome.error.startswith("unexpected RuntimeError: parser bug") and "second line" not in outcome.error
    with pytest.raises(RuntimeError):
        ingest_one(DocumentStore(), path, debug=True)


def test_a_store_that_cannot_be_written_is_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(self: DocumentStore, doc: object) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DocumentStore, "put", full)
    outcome = ingest_one(DocumentStore(), good_pdf(tmp_path / "a.pdf", "a"))
    assert outcome.status == "failed" and "No space left on device" in str(outcome.error)
    assert "MASKKV_HOME" in str(outcome.error)


def test_tally_summary() -> None:
    tally = Tally()
    for status, n in (("stored", 14), ("already", 2), ("failed", 3)):
        for _ in range(n):
            tally.add(Outcome(path=Path("x"), status=status))
    assert tally.summary() == "14 stored, 2 already in the store, 3 failed"
    assert Tally().summary() == "no files to ingest"


# -- crash safety -----------------------------------------------------------------------------------------

# Runs `maskkv ingest FOLDER` with the store's chunked writer slowed down: the third document's entry is
# half written, then the process says so (a marker file) and waits to be killed.
_HALTING_INGEST = """
import signal, sys, time
from pathlib import Path
# Ctrl-C as in a terminal, whatever the test run passed on: a process started with SIGINT ignored (a background
# job of a non-interactive shell) keeps it ignored, and Python then installs no KeyboardInterrupt handler
signal.signal(signal.SIGINT, signal.default_int_handler)
import maskkv_cli.documents.store as store
marker, folder = Path(sys.argv[1]), sys.argv[2]
write, calls = store._write_all, []
def halting(fh, data):
    calls.append(1)
    if len(calls) == 3:
        fh.write(data[: len(data) // 2])
        fh.flush()
        marker.write_text("half of the third entry is on disk")
        time.sleep(600)
    write(fh, data)
store._write_all = halting
from maskkv_cli.cli import app
sys.argv = ["maskkv", "ingest", folder]
app()
"""


def _halt_in_the_third_write(tmp_path: Path, folder: Path, sig: int) -> tuple[int, str, str]:
    """Run the halting ingest over ``folder``, send ``sig`` once it is halfway; return (code, stdout, stderr)."""
    marker = tmp_path / "halted"
    proc = subprocess.Popen([sys.executable, "-c", _HALTING_INGEST, str(marker), str(folder)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), proc.communicate()[1].decode() if proc.poll() is not None else "timed out"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out.decode(), err.decode()


def test_kill_9_halfway_through_a_folder_then_rerun(tmp_path: Path) -> None:
    folder = tmp_path / "reports"
    files = [good_pdf(folder / f"report{i:02d}.pdf", f"number {i}") for i in range(6)]
    code, _, _ = _halt_in_the_third_write(tmp_path, folder, signal.SIGKILL)
    assert code == -signal.SIGKILL

    store = DocumentStore()
    leftovers = [p for p in store.folder.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1  # the kill really came in the middle of writing an entry
    for path in store.folder.glob("*.json"):  # no entry file is partial, listed or not
        assert json.loads(path.read_text())["pages"]
    entries = store.list()
    assert sorted(Path(e.source).name for e in entries) == ["report00.pdf", "report01.pdf"]
    for entry in entries:  # the listed ones are complete
        doc = store.get(entry.sha256)
        assert doc is not None and doc.pages == load_document(entry.source).pages

    result = run("ingest", folder)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == "4 stored, 2 already in the store"
    assert stored_sources() == [f.name for f in files]


def test_ctrl_c_reports_what_was_done_and_leaves_no_temp_file(tmp_path: Path) -> None:
    folder = tmp_path / "reports"
    files = [good_pdf(folder / f"report{i:02d}.pdf", f"number {i}") for i in range(6)]
    code, out, err = _halt_in_the_third_write(tmp_path, folder, signal.SIGINT)
    assert code == 130
    assert out.splitlines()[-1] == "2 stored"
    assert err.splitlines()[-1].startswith("error: interrupted with 4 of 6 files not done")
    assert "Traceback" not in err
    store = DocumentStore()
    assert not [p for p in store.folder.iterdir() if p.name.startswith(".tmp-")]
    assert len(store.list()) == 2
    assert run("ingest", folder).stdout.splitlines()[-1] == "4 stored, 2 already in the store"
    assert stored_sources() == [f.name for f in files]


def test_errors_name_the_file_once(tmp_path: Path) -> None:
    missing, odd = tmp_path / "missing.pdf", tmp_path / "notes.xyz"
    odd.write_text("x")
    result = run("ingest", missing, odd, bad_pdf(tmp_path / "bad.pdf"))
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 3
    for line, path in zip(lines, (missing, odd, tmp_path / "bad.pdf"), strict=True):
        assert str(path) in line and line.count(path.name) == 1, line


def test_removing_a_document_that_is_not_stored_exits_1_as_other_not_found_errors() -> None:
    result = run("ingest", "--remove", "nope")
    assert result.exit_code == 1
    assert result.stderr.strip() == ("error: No stored document matches 'nope'; `maskkv ingest --list` shows the "
                                     "stored documents' hashes and names.")


@pytest.mark.parametrize("args", [["--list", "--remove", "x"], ["doc.txt", "--list"], ["doc.txt", "--remove", "x"]])
def test_files_list_and_remove_are_one_at_a_time(tmp_path: Path, args: list[str]) -> None:
    """Not one of them silently ignored: a usage error, and nothing listed, removed or stored."""
    (tmp_path / "doc.txt").write_text("The special magic number for apple is 12345.\n")
    result = run("ingest", *[str(tmp_path / a) if a == "doc.txt" else a for a in args])
    assert result.exit_code == 2 and "one of them" in result.stderr and not result.stdout


def test_a_stored_document_is_found_by_a_relative_path_or_by_a_copy_stored_under_another_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--remove`` with a relative path finds the stored absolute source, and a file whose content is stored
    under another name (ingested from a/draft.txt, asked for as b/final.txt) finds that entry (both said "no
    stored document matches")."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "draft.txt").write_text("Same text in two places.\n")
    (tmp_path / "b" / "final.txt").write_text("Same text in two places.\n")
    monkeypatch.chdir(tmp_path)
    store = DocumentStore()
    store.ingest("a/draft.txt")
    entry = store.find("a/draft.txt")
    assert entry.source == str(tmp_path / "a" / "draft.txt")
    assert store.find("b/final.txt").sha256 == entry.sha256
    with pytest.raises(MaskKVError, match="No stored document matches"):
        store.find("nope.txt")


def test_ingesting_an_edited_file_again_names_its_earlier_versions(tmp_path: Path) -> None:
    """The earlier version stayed in the store without a word, beside the new one of the same path."""
    src = tmp_path / "notes.txt"
    src.write_text("The special magic number for apple is 4821. Version one.\n")
    first = runner.invoke(app, ["ingest", str(src), "--json"])
    old = json.loads(first.stdout)["documents"][0]["sha256"]
    src.write_text("The special magic number for apple is 9999. Version two.\n")
    again = runner.invoke(app, ["ingest", str(src)])
    assert again.exit_code == 0, again.output
    assert (f"note: notes.txt: 1 earlier version(s) of this file are stored too ({old[:12]}); `maskkv ingest "
            f"--remove {old[:12]}` removes one") in again.stderr
    assert runner.invoke(app, ["ingest", "--remove", old[:12]]).exit_code == 0
    assert "earlier version" not in runner.invoke(app, ["ingest", str(src)]).stderr  # none left


def test_a_folder_with_no_document_is_no_success(tmp_path: Path) -> None:
    """An empty folder (or one of .csv files) said "no files to ingest" and exited 0: a script could not tell."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "tables").mkdir()
    (tmp_path / "tables" / "t.csv").write_text("a,b\n")
    for folder in ("empty", "tables"):
        result = runner.invoke(app, ["ingest", str(tmp_path / folder)])
        assert result.exit_code == 1 and f"error: no document to ingest in {tmp_path / folder}: maskkv reads .pdf" \
            in result.stderr, result.output


def test_ingest_says_when_the_default_model_it_would_count_with_is_not_there(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With MASKKV_MODEL naming nothing it said the embedded tokenizer was "the model ask uses by default", and the
    next ask refused the default."""
    monkeypatch.setenv("MASKKV_MODEL", str(tmp_path / "nope"))
    doc = tmp_path / "a.txt"
    doc.write_text("The special magic number for apple is 4821.\n")
    result = runner.invoke(app, ["ingest", str(doc)])
    assert result.exit_code == 0, result.output
    assert f"since MASKKV_MODEL={tmp_path / 'nope'} names no usable model (ask refuses it until it is fixed)" \
        in result.stderr and "the model ask uses by default" not in result.stderr
