"""Tests for maskkv_cli.documents.store: the on-disk document cache."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maskkv_cli.documents import Document, Page
from maskkv_cli.documents.store import DocumentStore, default_root
from maskkv_cli.errors import DocumentError, MaskKVError, UsageError

REPO = Path(__file__).resolve().parents[1]


def make_doc(sha: str, source: str = "/docs/a.txt", text: str = "hello world") -> Document:
    return Document(source=source, kind="text", pages=(Page(1, text),), sha256=sha, warnings=())


def sha_of(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


def leftovers(store: DocumentStore) -> list[str]:
    return sorted(p.name for p in store.folder.iterdir() if not p.name.endswith(".json"))


def test_default_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MASKKV_HOME", str(tmp_path / "home"))
    assert default_root() == tmp_path / "home"
    assert DocumentStore().folder == tmp_path / "home" / "documents"
    monkeypatch.delenv("MASKKV_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root() == tmp_path / "xdg" / "maskkv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert default_root() == tmp_path / "user" / ".cache" / "maskkv"


def test_put_get_round_trip(tmp_path: Path) -> None:
    store = DocumentStore(tmp_path)
    doc = Document(
        source="/docs/report.pdf",
        kind="pdf",
        pages=(Page(1, "first"), Page(3, "third — ünïcode")),
        sha256=sha_of("report"),
        warnings=("no extractable text on 1 page (2)",),
    )
    path = store.put(doc)
    assert path == tmp_path / "documents" / f"{doc.sha256}.json"
    assert (path.stat().st_mode & 0o777) == 0o600
    assert leftovers(store) == []
    assert store.get(doc.sha256) == doc
    assert store.get(doc.sha256.upper()) == doc
    assert store.get(sha_of("other")) is None
    assert store.get("not-a-hash") is None
    store.put(doc)  # replacing an entry is fine
    assert [e.sha256 for e in store.list()] == [doc.sha256]


def test_list_entries(tmp_path: Path) -> None:
    store = DocumentStore(tmp_path)
    assert store.list() == []  # no folder yet
    a = make_doc(sha_of("a"), "/docs/a.txt", "alpha")
    b = Document(source="/x/b.md", kind="markdown", pages=(Page(1, "b1"), Page(2, "b22")), sha256=sha_of("b"))
    store.put(a)
    store.put(b)
    entries = {e.sha256: e for e in store.list()}
    assert set(entries) == {a.sha256, b.sha256}
    eb = entries[b.sha256]
    assert (eb.source, eb.kind, eb.pages, eb.name) == ("/x/b.md", "markdown", 2, "b.md")
    assert eb.chars == len("b1\n\nb22")
    assert eb.ingested_at.endswith("+00:00")
    assert eb.path == store.path_for(b.sha256)


def test_corrupt_entries_are_ignored(tmp_path: Path) -> None:
    store = DocumentStore(tmp_path)
    good = make_doc(sha_of("good"))
    store.put(good)
    bad_json = sha_of("bad json")
    store.path_for(bad_json).write_text('{"sha256": "' + bad_json + '", "pages": [', encoding="utf-8")
    wrong_shape = sha_of("wrong shape")
    store.path_for(wrong_shape).write_text(json.dumps({"sha256": wrong_shape, "pages": 3}), encoding="utf-8")
    not_object = sha_of("list")
    store.path_for(not_object).write_text("[1, 2]", encoding="utf-8")
    mismatch = sha_of("mismatch")
    record = json.loads(store.path_for(good.sha256).read_text(encoding="utf-8"))
    store.path_for(mismatch).write_text(json.dumps(record), encoding="utf-8")  # claims another hash
    store.path_for(sha_of("binary")).write_bytes(b"\xff\xfe\x00garbage")
    (store.folder / ".tmp-abandoned.part").write_text('{"sha256": "half', encoding="utf-8")
    (store.folder / "notes.json").write_text("{}", encoding="utf-8")

    assert [e.sha256 for e in store.list()] == [good.sha256]
    for sha in (bad_json, wrong_shape, not_object, mismatch, sha_of("binary")):
        assert store.get(sha) is None
    assert store.get(good.sha256) == good


def test_remove_by_prefix_and_name(tmp_path: Path) -> None:
    store = DocumentStore(tmp_path)
    a = make_doc(sha_of("a"), "/docs/alpha.txt")
    b = make_doc(sha_of("b"), "/docs/beta.pdf")
    store.put(a)
    store.put(b)
    removed = store.remove(a.sha256[:6])
    assert removed.sha256 == a.sha256
    assert store.get(a.sha256) is None
    assert store.remove("beta.pdf").sha256 == b.sha256
    assert store.list() == []


def test_remove_errors(tmp_path: Path) -> None:
    store = DocumentStore(tmp_path)
    one = make_doc("abcdef" + "0" * 58, "/one/notes.txt")
    two = make_doc("abcdef" + "1" * 58, "/two/notes.txt")
    store.put(one)
    store.put(two)
    with pytest.raises(UsageError, match=r"'abcdef' matches 2 stored documents: abcdef000000 \(notes.txt, stored "
                                         r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\), .*; give the hash of the one to remove"):
        store.remove("abcdef")
    with pytest.raises(UsageError, match="matches 2 stored documents"):
        store.remove("notes.txt")
    with pytest.raises(UsageError, match="too short to match a hash; give at least 6 characters"):
        store.remove("abc")
    with pytest.raises(MaskKVError, match="No stored document matches 'missing.pdf'") as missing:
        store.remove("missing.pdf")
    assert missing.value.exit_code == 1  # not found, as every other missing thing; not a usage error
    with pytest.raises(MaskKVError, match="No stored document matches 'ffffff'"):
        store.remove("ffffff")
    with pytest.raises(UsageError, match="Give a document to remove"):
        store.remove("  ")
    assert store.remove("abcdef1").source == "/two/notes.txt"
    assert store.remove("/one/notes.txt").sha256 == one.sha256


def test_a_path_of_an_edited_file_removes_the_version_of_its_present_bytes(tmp_path: Path) -> None:
    """Two versions of one edited file: '--remove notes.txt' asked for "a longer hash" (both given in full)."""
    store = DocumentStore(tmp_path / "store")
    src = tmp_path / "notes.txt"
    src.write_text("Version one.\n")
    old, _ = store.ingest(src)
    src.write_text("Version two.\n")
    new, _ = store.ingest(src)
    assert {e.sha256 for e in store.list()} == {old.sha256, new.sha256}
    assert store.remove(str(src)).sha256 == new.sha256  # the path names the file as it is
    src.unlink()
    assert store.remove(str(src)).sha256 == old.sha256  # the one left


def test_ingest_caches_by_content(tmp_path: Path) -> None:
    store = DocumentStore(tmp_path / "store")
    src = tmp_path / "paper.txt"
    src.write_text("Some text about boats.\n", encoding="utf-8")
    doc, cached = store.ingest(src)
    assert not cached
    assert doc.sha256 == hashlib.sha256(src.read_bytes()).hexdigest()
    assert store.get(doc.sha256) == doc
    again, cached = store.ingest(src)
    assert cached and again == doc
    copy = tmp_path / "copy.txt"
    copy.write_bytes(src.read_bytes())
    moved, cached = store.ingest(copy)
    assert cached and moved.source == str(copy) and moved.pages == doc.pages
    src.write_text("Different text now.\n", encoding="utf-8")
    changed, cached = store.ingest(src)
    assert not cached and changed.sha256 != doc.sha256
    assert len(store.list()) == 2


def test_the_same_bytes_under_another_name_are_read_as_what_they_are(tmp_path: Path) -> None:
    """A PDF copied to ``.txt`` was read as Windows-1252 text (two pages of PDF syntax), and once stored that
    reading was handed back for the PDF itself, its note naming the other file. A PDF is a PDF whatever its name;
    the same bytes as Markdown and as text are each read as what they are named; a stored note names this file."""
    from pdfs import make_pdf

    store = DocumentStore(tmp_path / "store")
    pdf = tmp_path / "report.pdf"
    pdf.write_bytes(make_pdf([["The special magic number for lemon is 7123."], ["Second page."]]))
    copy = tmp_path / "report-copy.txt"
    copy.write_bytes(pdf.read_bytes())
    as_text, cached = store.ingest(copy)
    assert not cached and as_text.kind == "pdf" and len(as_text.pages) == 2 and "7123" in as_text.pages[0].text
    doc, cached = store.ingest(pdf)
    assert cached and doc.kind == "pdf" and doc.pages == as_text.pages
    latin = tmp_path / "latin.txt"
    latin.write_bytes("Caf\xe9 au lait, cr\xe8me br\xfbl\xe9e.\n".encode("latin-1"))
    assert any("latin.txt is not UTF-8" in w for w in store.ingest(latin)[0].warnings)
    (tmp_path / "other.txt").write_bytes(latin.read_bytes())
    notes = store.ingest(tmp_path / "other.txt")[0].warnings
    assert any("other.txt is not UTF-8" in w for w in notes) and not any("latin.txt" in w for w in notes)
    (tmp_path / "notes.md").write_bytes(b"# Title\n\nSome text.\n")
    (tmp_path / "notes.txt").write_bytes((tmp_path / "notes.md").read_bytes())
    assert store.ingest(tmp_path / "notes.md")[0].kind == "markdown"
    plain, cached = store.ingest(tmp_path / "notes.txt")
    assert plain.kind == "text" and not cached


def test_a_stored_encrypted_pdf_needs_its_password(tmp_path: Path) -> None:
    """The store kept an encrypted PDF's text, and handed it back to a second ingest with no password or a wrong
    one; reading the file itself refuses both."""
    from pdfs import make_pdf

    store = DocumentStore(tmp_path / "store")
    path = tmp_path / "secret.pdf"
    path.write_bytes(make_pdf([["Private figures: 4821."]], password="s3cret", algorithm="RC4-128"))
    doc, cached = store.ingest(path, password="s3cret")
    assert not cached and "4821" in doc.text
    with pytest.raises(DocumentError, match="password-protected"):
        store.ingest(path)
    with pytest.raises(DocumentError, match="Wrong password"):
        store.ingest(path, password="nope")
    assert store.ingest(path, password="s3cret") == (doc, True)


def test_ingest_errors_are_document_errors(tmp_path: Path) -> None:
    store = DocumentStore(tmp_path / "store")
    with pytest.raises(DocumentError, match="File not found"):
        store.ingest(tmp_path / "missing.txt")
    (tmp_path / "empty.md").write_bytes(b"")
    with pytest.raises(DocumentError, match="is empty"):
        store.ingest(tmp_path / "empty.md")
    assert store.list() == []


def test_ingest_survives_unwritable_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DocumentStore(tmp_path / "store")
    src = tmp_path / "a.txt"
    src.write_text("text", encoding="utf-8")

    def full_disk(doc: Document) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "put", full_disk)
    doc, cached = store.ingest(src)
    assert not cached and doc.text == "text"
    assert any("Could not save a.txt to the document cache" in w for w in doc.warnings)


def test_failed_write_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import maskkv_cli.documents.store as store_module

    store = DocumentStore(tmp_path)
    store.put(make_doc(sha_of("keep")))

    def broken(fh: object, data: bytes) -> None:
        raise OSError(5, "I/O error")

    monkeypatch.setattr(store_module, "_write_all", broken)
    with pytest.raises(OSError):
        store.put(make_doc(sha_of("lost")))
    assert leftovers(store) == []
    assert [e.sha256 for e in store.list()] == [sha_of("keep")]


def test_stale_temp_files_are_cleaned(tmp_path: Path) -> None:
    store = DocumentStore(tmp_path)
    store.folder.mkdir(parents=True)
    stale = store.folder / ".tmp-old.part"
    fresh = store.folder / ".tmp-new.part"
    stale.write_text("x")
    fresh.write_text("x")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    store.put(make_doc(sha_of("a")))
    assert leftovers(store) == [".tmp-new.part"]  # a younger one may belong to a live writer


_KILLED_WRITER = r"""
import sys, time
from pathlib import Path
import maskkv_cli.documents.store as store
from maskkv_cli.documents import Document, Page

def slow_write(fh, data):
    fh.write(data[: len(data) // 2])
    fh.flush()
    print("half written", flush=True)
    time.sleep(60)
    fh.write(data[len(data) // 2 :])

store._write_all = slow_write
pages = tuple(Page(i + 1, ("page %d " % i) * 500) for i in range(40))
doc = Document(source="/docs/big.txt", kind="text", pages=pages, sha256="f" * 64)
store.DocumentStore(Path(sys.argv[1])).put(doc)
"""


def test_killed_writer_leaves_store_readable(tmp_path: Path) -> None:
    store = DocumentStore(tmp_path)
    kept = make_doc(sha_of("kept"))
    store.put(kept)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "half written", proc.stderr.read() if proc.stderr else line
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    partial = [p for p in store.folder.iterdir() if p.name.startswith(".tmp-")]
    assert len(partial) == 1 and partial[0].stat().st_size > 0  # the half-written temp file
    assert not store.path_for("f" * 64).exists()
    assert store.get("f" * 64) is None
    assert [e.sha256 for e in store.list()] == [kept.sha256]
    assert store.get(kept.sha256) == kept
    big = make_doc("f" * 64, "/docs/big.txt", "complete now")
    store.put(big)
    assert store.get("f" * 64) == big
    assert {e.sha256 for e in store.list()} == {kept.sha256, big.sha256}
