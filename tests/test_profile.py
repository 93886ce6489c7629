from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from pdfs import BODY, make_pdf
from typer.testing import CliRunner

from maskkv_cli.cli import app
from maskkv_cli.cli.parsing import choose_focus, parse_runs
from maskkv_cli.defaults import DEFAULT_POLICY
from maskkv_cli.documents import Document, Page
from maskkv_cli.engine.selection import LayerRecord
from maskkv_cli.errors import UsageError
from maskkv_cli.reports.pagemap import OUTSIDE, PageCount, group_pages, kept_position_counts, page_map, token_pages
from maskkv_cli.reports.profile_report import RunSpec, quantize

runner = CliRunner()
FAST = ["-n", "8", "--steps", "8", "--block-length", "8"]
ENV = {"COLUMNS": "100"}


@pytest.fixture
def pdf(tmp_path):
    path = tmp_path / "story.pdf"
    path.write_bytes(make_pdf(BODY))
    return path


def run(*args):
    return runner.invoke(app, ["profile", *[str(a) for a in args]], env=ENV)


def one_line_error(result, code, *fragments):
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for f in fragments:
        assert f in lines[-1], (f, lines[-1])


# ------------------------------------------------------------------------------------------------- CLI


def test_table_heatmap_and_page_map(pdf, tiny_dir):
    result = run(pdf, "What does the keeper write?", "--model", tiny_dir, "--policies", "maskkv,snapkv",
                 "--budgets", "16,32", *FAST)
    assert result.exit_code == 0, result.output
    out = result.stdout
    for label in ("maskkv@16", "maskkv@32", "snapkv@16", "snapkv@32"):
        assert label in out
    assert "full prompt KV cache" in out and "KV kept" in out and "x1.9" in out  # row 2 keeps ~2x row 1
    assert "pictures of maskkv@16" in out and "kept entries per head" in out
    assert re.search(r"^\s+L0 [.:\-=+*#%@]{8}$", out, re.M)  # 4 heads, two characters per cell (no colours)
    assert "P_h" in out
    assert "no calibration profile was used" in out
    assert "where the kept K/V come from" in out and OUTSIDE in out
    assert "cumulative" in out  # CPU peak memory is RSS over the whole process
    assert max(len(line) for line in out.splitlines()) <= 100


def test_json_structure(pdf, tiny_dir, tiny_config):
    result = run(pdf, "--model", tiny_dir, "--policies", "maskkv,snapkv,full", "--budgets", "16", "--json",
                 "--quiet", *FAST)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # nothing else on stdout
    assert data["document"]["pages"] == 5
    assert data["question"] == "Summarize the document."
    assert [r["label"] for r in data["runs"]] == ["maskkv@16", "snapkv@16", "full"]
    assert data["focus"] == 0
    n_layers, n_heads = tiny_config.n_layers, tiny_config.n_heads
    for r in data["runs"]:
        heads = r["head_budgets"]
        assert len(heads) == n_layers and all(len(row) == n_heads for row in heads)
        assert [sum(row) for row in heads] == [n_heads * b for b in r["layer_budgets"]]
        pages = r["pages"]
        assert pages["mapped"] is True and [p["page"] for p in pages["pages"]] == [1, 2, 3, 4, 5]
        kept = sum(p["kept"] for p in pages["pages"]) + pages[OUTSIDE]["kept"]
        assert kept == pages["kept_total"] == r["stats"]["kv_entries"]
        tokens = sum(p["tokens"] for p in pages["pages"]) + pages[OUTSIDE]["tokens"]
        assert tokens == r["prompt_tokens"]
        assert all(p["tokens"] > 0 for p in pages["pages"])
    maskkv, snapkv, full = data["runs"]
    assert maskkv["evicted"] and maskkv["budget"] == 16 and maskkv["layer_budgets"] == [16] * n_layers
    assert maskkv["preference"] is not None and len(maskkv["preference"]) == n_layers
    assert maskkv["importance"] is None and maskkv["importance_source"] is None
    assert snapkv["preference"] is None
    assert not full["evicted"] and full["budget"] is None and full["stats"]["compression"] == 1.0
    assert all(p["share"] == 1.0 for p in full["pages"]["pages"])
    assert maskkv["stats"]["kv_bytes"] < full["stats"]["kv_bytes"]


def test_html_report(pdf, tiny_dir, tmp_path):
    target = tmp_path / "report.html"
    result = run(pdf, "--model", tiny_dir, "--budgets", "16", "--html", target, *FAST)
    assert result.exit_code == 0, result.output
    page = target.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert '<table class="heat">' in page and "kept entries per head" in page
    assert "where the kept K/V come from" in page
    assert not re.search(r"(src|href)\s*=", page)  # no external assets
    data = page.split("id='maskkv-profile'>")[1].split("</script>")[0]
    assert json.loads(data)["runs"][0]["label"] == f"{DEFAULT_POLICY}@16"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left
    assert f"wrote {target}" in result.stderr
    # the answer as the terminal words it, with its confidence (it showed the raw text alone, no confidence)
    assert "<th>confidence</th>" in page and "LOW CONFIDENCE (mean" in page
    assert re.search(r"<td class='note'>LOW 0\.\d\d</td>", page)


def test_html_report_words_an_absence_as_the_terminal_does(pdf, tmp_path):
    """The embedded model asked another form of question: the page said "not in the document" as a finding."""
    target = tmp_path / "who.html"
    result = run(pdf, "Who wrote it?", "--budgets", "16", "--html", target, *FAST)
    assert result.exit_code == 0, result.output
    page = target.read_text(encoding="utf-8")
    assert "only answers questions of the form" in page and "<td>n/a</td>" in page


def test_plot_png(pdf, tiny_dir, tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "report.png"
    result = run(pdf, "--model", tiny_dir, "--policies", "maskkv,full", "--budgets", "16", "--plot", target,
                 "--quiet", *FAST)
    assert result.exit_code == 0, result.output
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(pdf, tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    result = run(pdf, "--model", tiny_dir, "--plot", tmp_path / "p.png", *FAST)
    one_line_error(result, 1, "pip install 'maskkv[plot]'")
    assert not (tmp_path / "p.png").exists()


def test_a_report_never_overwrites_the_document_or_the_other_report(pdf, tiny_dir, tmp_path):
    """``--html`` naming the document, ``--plot`` and ``--html`` naming one file, and ``--plot`` naming another
    picture format are refused before anything runs (the document was replaced by the HTML; one report by the
    other; a .jpg held PNG bytes)."""
    before = pdf.read_bytes()
    one_line_error(run(pdf, "--model", tiny_dir, "--html", pdf, *FAST), 2, "is the document itself")
    assert pdf.read_bytes() == before
    same = tmp_path / "same.png"
    one_line_error(run(pdf, "--model", tiny_dir, "--plot", same, "--html", same, *FAST), 2, "name the same file")
    one_line_error(run(pdf, "--model", tiny_dir, "--plot", tmp_path / "p.jpg", *FAST), 2, "ending in .png")
    assert not same.exists() and not (tmp_path / "p.jpg").exists()


def test_heatmap_choice_and_layer_importance(pdf, tiny_dir, tiny_config):
    data = json.loads(run(pdf, "--model", tiny_dir, "--policies", "snapkv,maskkv", "--budgets", "16,32",
                          "--heatmap", "maskkv@32", "--layer-budgets", "online", "--json", *FAST).stdout)
    assert data["focus"] == 3 and data["runs"][3]["label"] == "maskkv@32"
    chosen = data["runs"][3]
    assert chosen["importance_source"] == "online" and len(chosen["importance"]) == tiny_config.n_layers
    assert sum(chosen["layer_budgets"]) == 32 * tiny_config.n_layers
    assert data["runs"][0]["importance"] is None  # snapkv uses no layer importance

    assert runner.invoke(app, ["calibrate", "--model", str(tiny_dir), str(pdf), "--quiet"]).exit_code == 0
    result = run(pdf, "--model", tiny_dir, "--budgets", "16", *FAST)
    assert result.exit_code == 0, result.output
    assert "I(l) from the model's calibration profile" in result.stdout
    data = json.loads(run(pdf, "--model", tiny_dir, "--budgets", "16", "--json", *FAST).stdout)
    assert data["runs"][0]["importance_source"] == "profile"


def test_truncated_document_maps_only_the_prompt(tiny_dir, tmp_path):
    doc = tmp_path / "long.txt"
    doc.write_text("".join(f"Page {i} says the river runs past the mill. " * 30 + "\f" for i in range(1, 31)))
    result = run(doc, "Where?", "--model", tiny_dir, "--budgets", "32", "--json", *FAST)
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)["runs"][0]
    assert r["dropped_tokens"] > 0 and r["pages"]["dropped_tokens"] == r["dropped_tokens"]
    tokens = {p["page"]: p["tokens"] for p in r["pages"]["pages"]}
    assert tokens[1] > 0 and tokens[30] > 0 and tokens[15] == 0  # the middle is not in the prompt
    assert sum(p["kept"] for p in r["pages"]["pages"]) + r["pages"][OUTSIDE]["kept"] == r["stats"]["kv_entries"]
    text = run(doc, "Where?", "--model", tiny_dir, "--budgets", "32", *FAST)
    assert "cut from the middle" in text.stdout and "dropped" in text.stderr


def test_nothing_evicted(pdf, tiny_dir):
    result = run(pdf, "--model", tiny_dir, "--budgets", "4096", *FAST)
    assert result.exit_code == 0, result.output
    assert "keeps all" in result.stdout and "no run evicted anything" in result.stdout


@pytest.mark.parametrize(
    "args,code,fragment",
    [
        (["--policies", "maskkv,nosuch"], 2, "--policies: unknown policy 'nosuch'; choose one of: none, full,"),
        (["--policies", " , "], 2, "--policies is empty"),
        (["--budgets", "64,0"], 2, "positive"),
        (["--budgets", "-5"], 2, "positive"),
        (["--budgets", "lots"], 2, "--budgets"),
        (["--ratio", "1.5"], 2, "--ratio"),
        (["--budgets", "64", "--ratio", "0.5"], 2, "not both"),
        (["--heatmap", "snapkv@64"], 2, "--heatmap"),
        (["--layer-budgets", "sometimes"], 2, "--layer-budgets"),
    ],
)
def test_bad_options(pdf, tiny_dir, args, code, fragment):
    one_line_error(run(pdf, "--model", tiny_dir, *args), code, fragment)


def test_bad_output_folder(pdf, tiny_dir, tmp_path):
    one_line_error(run(pdf, "--model", tiny_dir, "--html", tmp_path / "nope" / "r.html"), 2, "does not exist")


# ------------------------------------------------------------------------------------------------- core


def _doc(*texts: str) -> Document:
    return Document("hand.txt", "text", tuple(Page(i + 1, t) for i, t in enumerate(texts)), "0" * 64)


def _words(text: str) -> list[tuple[int, int]]:
    """Offsets of a toy tokenizer: every run of non-spaces, and every run of spaces, is one token."""
    return [m.span() for m in re.finditer(r"\S+|\s+", text)]


def _record(layer: int, positions: list[list[int]] | None, lengths: list[int]) -> LayerRecord:
    pos = None if positions is None else torch.tensor([positions])
    return LayerRecord(layer, max(lengths), torch.tensor([lengths]), None, pos)


def test_page_map_hand_made():
    doc = _doc("alpha beta", "gamma", "delta eps")  # text: "alpha beta\n\ngamma\n\ndelta eps"
    text = "<hdr>" + doc.text + "\n\nQ?"
    offsets = _words(text)
    tokens = [text[a:b] for a, b in offsets]
    assert tokens == ["<hdr>alpha", " ", "beta", "\n\n", "gamma", "\n\n", "delta", " ", "eps", "\n\n", "Q?"]
    pages, note = token_pages(doc, doc.text, text, offsets)
    assert note is None
    # "<hdr>alpha" starts outside the document but holds its first word: it belongs to page 1
    assert pages == [1, 1, 1, 1, 2, 2, 3, 3, 3, None, None]
    # 2 layers x 2 heads; position lists are padded with the last kept position beyond each head's budget
    records = [
        _record(0, [[0, 2, 2], [4, 6, 8]], [2, 3]),  # head 0 keeps {0, 2}; head 1 keeps {4, 6, 8}
        _record(1, [[10, 10, 10], [2, 4, 10]], [1, 3]),  # head 0 keeps {10}; head 1 keeps {2, 4, 10}
    ]
    counts = kept_position_counts(records, len(offsets))
    assert counts == [1, 0, 2, 0, 2, 0, 1, 0, 1, 0, 2]
    pm = page_map(counts, pages, [1, 2, 3], slots_per_token=4)
    assert [(p.page, p.tokens, p.kept) for p in pm.pages] == [(1, 4, 3), (2, 2, 2), (3, 3, 2)]
    assert (pm.outside.tokens, pm.outside.kept) == (2, 2)
    assert pm.kept_total == 9 == sum(int(r.head_budgets.sum()) for r in records)
    assert pm.pages[0].share == 3 / 16
    assert pm.as_dict()[OUTSIDE] == {"tokens": 2, "kept": 2, "share": 2 / 8}


def test_dense_records_count_every_position():
    records = [_record(0, None, [5, 5, 5])]
    assert kept_position_counts(records, 5) == [3] * 5


def test_token_pages_with_a_cut_middle():
    doc = _doc("one one one", "two two two", "three three")
    context = doc.text[:9] + "\n...\n" + doc.text[-7:]  # "one one o" ... "e three"
    text = "U:" + context + "\n\nQ?"
    offsets = _words(text)
    pages, note = token_pages(doc, context, text, offsets)
    kept = {text[a:b]: p for (a, b), p in zip(offsets, pages, strict=True)}
    assert kept["U:one"] == 1 and kept["three"] == 3 and kept["Q?"] is None
    assert 2 not in pages
    assert note is not None and "cut" in note


def test_token_pages_not_found():
    doc = _doc("some text")
    pages, note = token_pages(doc, "other words", "prompt", [(0, 6)])
    assert pages == [None] and "not found" in note


def test_parse_runs_and_focus():
    specs = parse_runs("maskkv,full,snapkv", "64,256,64", None)
    assert [s.label for s in specs] == ["maskkv@64", "maskkv@256", "full", "snapkv@64", "snapkv@256"]
    ratios = parse_runs("maskkv", None, "0.1,0.5")
    assert ratios == [RunSpec("maskkv", ratio=0.1), RunSpec("maskkv", ratio=0.5)]
    assert [s.label for s in ratios] == ["maskkv@0.1", "maskkv@0.5"]
    assert parse_runs("maskkv", None, None) == [RunSpec("maskkv", 256)]
    assert choose_focus(specs, "snapkv@256") == 4
    assert choose_focus(specs, "full") == 2
    assert choose_focus(ratios, "maskkv@0.50") == 1
    with pytest.raises(UsageError, match="POLICY@BUDGET"):
        choose_focus(specs, "maskkv")
    with pytest.raises(UsageError, match="unknown policy"):
        parse_runs("maskkv,bogus", None, None)
    with pytest.raises(UsageError, match="positive"):
        parse_runs("maskkv", "0", None)


def test_quantize_and_group_pages():
    levels, lo, hi = quantize([[0, 5], [10, 10]], 9)
    assert (lo, hi) == (0, 10) and levels == [[0, 4], [8, 8]]
    assert quantize([[3, 3]], 9)[0] == [[4, 4]]
    pages = [PageCount(i, 10, i, 40) for i in range(1, 8)]
    rows = group_pages(pages, 3)
    assert [label for label, _ in rows] == ["1-3", "4-6", "7"]
    assert rows[0][1].kept == 6 and rows[0][1].tokens == 30 and rows[0][1].slots == 120
    assert group_pages(pages, 10)[0][0] == "1"


def test_heatmap_fits_an_80_column_terminal():
    from rich.console import Console

    from maskkv_cli.cli.render_profile import GLYPHS, heatmap

    matrix = [[(7 * layer + 3 * head) % 300 + 10 for head in range(32)] for layer in range(32)]  # LLaDA-8B
    for color in (True, False):
        console = Console(width=80, record=True, force_terminal=color, color_system="truecolor" if color else None)
        console.print(heatmap(matrix, "kept", "entries", color, 80))
        lines = console.export_text().splitlines()
        assert len(lines) == 1 + 1 + 32 + 1 and max(map(len, lines)) <= 80
        assert len(lines[2]) == 4 + 2 * 32  # "  L0" label, two characters a cell
        lo, hi = min(map(min, matrix)), max(map(max, matrix))
        assert f"min {lo} " in lines[-1] and f"max {hi} " in lines[-1]
    plain = heatmap([[0.0] * 64, [1.0] * 64], "P_h", "", False, 80).plain.splitlines()
    assert plain[2] == " L0 " + GLYPHS[0] * 64 and plain[3] == " L1 " + GLYPHS[-1] * 64  # one character a cell


def test_profile_document_resets_cuda_peaks_between_runs(monkeypatch):
    from types import SimpleNamespace

    from maskkv_cli.models.config import named_config
    from maskkv_cli.reports.profile_report import profile_document
    from maskkv_cli.runtime.stats import RunStats

    resets: list[object] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    config = named_config("tiny")
    session = SimpleNamespace(device=torch.device("cuda"), model_path="m", tokenizer=None,
                              model=SimpleNamespace(config=config))
    from maskkv_cli.prompting.fit import FittedContext

    fitted = FittedContext("doc", 1, 0, 1, "", ((0, 3),), 3, source=((0, 3),))
    seen: list[str] = []

    def ask(session, context, question, gen, cache, **hooks):
        seen.append(cache.policy)
        result = SimpleNamespace(stats=RunStats(cache.policy, 10, 8), records=[], layer_budgets=None)
        return SimpleNamespace(text="ok", prompt_len=10, budget=None, result=result, notes=[], fitted=fitted,
                               confidence=None)

    monkeypatch.setattr("maskkv_cli.app.pipeline.ask", ask)
    report = profile_document(session, _doc("doc"), "Q?", None, [RunSpec("none"), RunSpec("full")], warmup=False)
    assert seen == ["none", "full"] and len(resets) == 2
    assert "reset before each run" in report.memory_note and report.focus is None
    assert report.runs[0].pages is None and "no prompt cache" in report.runs[0].pages_note


def test_the_table_shows_each_run_s_confidence_and_the_warm_up_apart(pdf, tiny_dir):
    result = run(pdf, "What does the keeper write?", "--model", tiny_dir, "--policies", "full,maskkv",
                 "--budgets", "16", *FAST)
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())  # the caption wraps
    assert "conf." in out and "LOW 0." in out  # the random test model guesses, and the table says so
    assert re.search(r"model load \d+\.\d+ (s|ms); warm-up: full ran once on this prompt first", out)
    assert "not in the table" in out
    assert out.count("LOW CONFIDENCE (") == 2  # under each answer, with its numbers
    data = json.loads(run(pdf, "Q?", "--model", tiny_dir, "--policies", "full", "--json", *FAST).stdout)
    assert data["warmup_s"] > 0 and data["load_s"] > 0 and data["runs"][0]["confidence"]["low"] is True
    cold = " ".join(run(pdf, "Q?", "--model", tiny_dir, "--policies", "full", "--no-warmup", *FAST).stdout.split())
    assert "no warm-up (--no-warmup): the first row includes one-time costs" in cold


def test_profile_reads_one_prompt_so_parts_are_refused(pdf, tiny_dir, monkeypatch):
    import maskkv_cli.cli.model_choice as model_choice

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(model_choice, "load_session", loaded)
    one_line_error(run(pdf, "Q?", "--model", tiny_dir, "--long", "parts", *FAST), 2,
                   "profile measures one prompt (ask reads a long document in parts): --long truncate or rope-scale")


def test_a_report_off_a_terminal_is_laid_out_whole(tiny_dir, tmp_path):
    """Written to a file or a pipe it was laid out 80 columns wide: cells cut ("LOW 0.…", "716.0 K…") and the
    answer's note of what was read cut off ("pages 3-4 were cut (--long truncat…")."""
    doc = tmp_path / "long.txt"
    doc.write_text("".join(f"Page {i} says the river runs past the mill. " * 30 + "\f" for i in range(1, 31)))
    result = runner.invoke(app, ["profile", str(doc), "Where does the river run past?", "--model", str(tiny_dir),
                                 "--policies", "maskkv-residual,snapkv", "--budgets", "32", *FAST],
                           env={"COLUMNS": None})
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout
    shown = " ".join(result.stdout.split())  # (a long line wraps: nothing of it is lost)
    assert re.search(r"maskkv-residual@32: .* \[read pages 1, 30 of 30; pages 2-29 were cut \(--long truncate; the "
                     r"default --long parts reads them all\)\]", shown), shown  # the read note whole
