"""The page at ``/`` in a real browser: headless Chromium from the system's packages (Debian's ``chromium``), driven
by Playwright with that browser (no browser download). It uploads a document, picks it, asks, and shows the
streamed answer, its confidence and the page map; nothing is fetched from anywhere but the server."""

from __future__ import annotations

import os
import shutil

import pytest
from serving import API_KEY, NEEDLE_ANSWER, QUESTION, needle_text

pytest.importorskip("starlette", reason="the serve extra is not installed: pip install -e '.[serve]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'")

CHROMIUM = os.environ.get("MASKKV_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine: the page's browser test needs "
                                "one (Debian: apt-get install chromium; or set MASKKV_CHROMIUM to its path)")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from maskkv_cli.app.session import Session
    from maskkv_cli.models.catalog import shipped_model
    from maskkv_cli.server import BackgroundServer, ServerConfig, create_app

    config = ServerConfig(api_key=API_KEY, store_root=tmp_path_factory.mktemp("store"))
    with BackgroundServer(create_app(Session(str(shipped_model())), config)) as url:
        yield url


@pytest.fixture()
def page(served):
    with sync_api.sync_playwright() as playwright:
        # Playwright gives the browser a fresh profile (user data folder) of its own
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            tab = browser.new_page()
            tab.set_default_timeout(60_000)
            yield tab
        finally:
            browser.close()


def test_the_page_asks_an_uploaded_document_in_headless_chromium(page, served, tmp_path):
    requested: list[str] = []
    page.on("request", lambda r: requested.append(r.url))
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)

    page.goto(served + "/")
    page.wait_for_selector("#model:has-text('not connected')")  # the key is needed for /v1
    page.fill("#key", API_KEY)
    page.dispatch_event("#key", "change")
    page.wait_for_selector("#model:has-text('tiny-llada')")
    assert "maskkv" in page.eval_on_selector_all("#policy option", "os => os.map(o => o.value)")
    problems.clear()  # the refused first load is expected; from here on nothing may fail

    document = tmp_path / "harbor.txt"
    document.write_text(needle_text(), encoding="utf-8")
    page.set_input_files("#file", str(document))
    page.click("#upload")
    page.wait_for_selector("#upload-status:has-text('stored: harbor.txt')")
    chosen = page.eval_on_selector("#document", "s => s.options[s.selectedIndex].text")
    assert chosen.startswith("harbor.txt (2 pages")

    page.fill("#question", QUESTION)
    page.fill("#budget", "64")
    page.click("#ask")
    page.wait_for_selector("#status:has-text('answered in')")
    assert page.inner_text("#answer").strip() == NEEDLE_ANSWER
    assert page.inner_text("#error") == ""
    confidence = page.inner_text("#confidence")
    assert confidence.startswith("confidence: mean ") and "lowest token" in confidence
    stats = page.inner_text("#stats")
    assert stats.startswith("maskkv, budget 64 entries per head: KV cache ") and "x smaller" in stats
    assert page.is_visible("#pagemap")
    rows = page.eval_on_selector_all("#pagemap tbody tr", "rs => rs.map(r => r.cells[0].textContent)")
    assert rows == ["1", "2", "question / template"]
    assert "entries kept in all" in page.inner_text("#pagemap-note")

    # a question the embedded model was not trained on: its "not in the document" says nothing, and the page said it
    # as an answer, with no note
    page.fill("#question", "Who keeps the harbor?")
    page.click("#ask")
    page.wait_for_selector("#status:has-text('answered in')")
    assert page.inner_text("#answer").strip() == "(no answer, see the note below)"
    assert "only answers questions of the form" in page.inner_text("#notes")

    assert not problems, problems
    # an encrypted PDF: the page has the password field the refusal names
    from pdfs import make_pdf

    locked = tmp_path / "locked.pdf"
    locked.write_bytes(make_pdf([["The special magic number for pier is 2718."]], password="pw"))
    page.set_input_files("#file", str(locked))
    page.click("#upload")
    page.wait_for_selector("#error:has-text('password')")
    problems.clear()  # (the browser logs the refused upload's 400)
    page.fill("#pdf-password", "pw")
    page.click("#upload")
    page.wait_for_selector("#upload-status:has-text('stored: locked.pdf')")

    assert not problems, problems
    assert requested and all(url.startswith(served) for url in requested), requested  # no CDN, nothing external
