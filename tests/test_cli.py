from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from maskkv_cli import __version__
from maskkv_cli.cli import app
from maskkv_cli.defaults import DEFAULT_POLICY

runner = CliRunner()


def test_version_and_help():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"maskkv {__version__}"
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "generate" in result.output


def test_help_does_not_import_torch():
    code = ("import sys\nfrom maskkv_cli.cli import app\ntry:\n    app(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules or 'transformers' in sys.modules else 'LIGHT')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("LIGHT")


def test_generate_end_to_end(tiny_dir):
    result = runner.invoke(app, ["generate", "--model", str(tiny_dir), "-n", "16", "--steps", "8",
                                 "--block-length", "8", "What is the river?"])
    assert result.exit_code == 0, result.output
    assert "prefill (step 0)" in result.stderr and "tokens/s" in result.stderr
    assert "prefill" not in result.stdout  # the figures on stderr, as ask's: `generate > answer.txt` holds the answer


def test_generate_json(tiny_dir):
    result = runner.invoke(app, ["generate", "--model", str(tiny_dir), "-n", "8", "--steps", "8",
                                 "--block-length", "8", "--json", "--policy", "snapkv", "--budget", "4",
                                 "the river " * 30])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["budget"] == 4 and data["stats"]["policy"] == "snapkv"
    assert data["stats"]["kv_bytes"] < data["stats"]["kv_full_bytes"]


def test_embedded_default_model_says_so():
    result = runner.invoke(app, ["generate", "-n", "8", "--steps", "8", "--block-length", "8", "hello"])
    assert result.exit_code == 0, result.output
    assert "embedded tiny" in result.stderr


def test_bad_model_path_is_one_line(tmp_path):
    result = runner.invoke(app, ["generate", "--model", str(tmp_path / "nope"), "hi"])
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: model folder {tmp_path / 'nope'} does not exist"
    assert "Traceback" not in result.output


def test_a_named_random_shape_as_model_says_where_it_belongs(tmp_path, monkeypatch):
    """`--model tiny` in a command that answers: the missing folder, and that such names are random-weight shapes
    for `plan` and the benchmarks' --config (a folder of that name, where there is one, is still what --model means)."""
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["generate", "--model", "tiny", "hi"])
    assert result.exit_code == 1
    speed = runner.invoke(app, ["bench", "speed", "--model", "tiny", "--out", "runs"])
    assert speed.exit_code == 1 and speed.stderr == result.stderr
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text("{}")  # a folder of that name: read as a checkpoint folder
    assert "random weights" not in runner.invoke(app, ["generate", "--model", "tiny", "hi"]).stderr
    assert result.stderr.strip() == ("error: model folder tiny does not exist; 'tiny' names a shape with random "
                                     "weights, for `maskkv plan --model` and `maskkv bench speed|memory|loading|reuse "
                                     "--config`: pass a checkpoint folder or ORG/NAME")


def test_model_folder_missing_files(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llada", "d_model": 64, "n_layers": 2,
                                                            "n_heads": 4, "vocab_size": 100}))
    result = runner.invoke(app, ["generate", "--model", str(tmp_path / "m"), "hi"])
    assert result.exit_code == 1 and "holds no weights" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_bad_options(tiny_dir):
    result = runner.invoke(app, ["generate", "--model", str(tiny_dir), "-n", "10", "--block-length", "8", "hi"])
    assert result.exit_code == 2 and "multiple of --block-length" in result.stderr
    result = runner.invoke(app, ["generate", "--model", str(tiny_dir), "--policy", "nope", "hi"])
    assert result.exit_code == 2 and "unknown policy 'nope'" in result.stderr
    result = runner.invoke(app, ["generate", "--model", str(tiny_dir), "--budget", "0", "hi"])
    assert result.exit_code == 2 and "--budget must be a positive integer" in result.stderr
    result = runner.invoke(app, ["generate", "--model", str(tiny_dir), "   "])
    assert result.exit_code == 2 and "empty" in result.stderr


def test_generate_refuses_a_prompt_and_answer_longer_than_the_window():
    """generate checked nothing: a 4k-token prompt ran on a 2k-token model, and -n 8192 ran for minutes."""
    long_prompt = "The river runs to the sea. " * 600
    result = runner.invoke(app, ["generate", "-n", "8", "--steps", "8", "--block-length", "8", long_prompt])
    assert result.exit_code == 2 and "of the model's 2128-token window: shorten the prompt" in result.stderr
    result = runner.invoke(app, ["generate", "-n", "8192", "--block-length", "8", "hi"])
    assert result.exit_code == 2 and "an answer of 8192 tokens" in result.stderr
    most = int(result.stderr.split("at most ")[1].split()[0])
    assert 2000 < most < 2128


def test_sampler_numbers_out_of_reach_are_refused_and_surplus_steps_cost_nothing(tiny_dir):
    """NaN and infinite temperatures or guidance are refused (NaN passed ``< 0`` and ran), as is a seed torch
    cannot take (a raw ValueError); a billion steps for 8 tokens answers as 8 steps do (it built a list of a
    billion commit counts and ran out of memory)."""
    for args, message in ((["-t", "nan"], "--temperature must be >= 0, got nan"),
                          (["-t", "inf"], "--temperature must be >= 0, got inf"),
                          (["--cfg", "nan"], "--cfg must be >= 0"),
                          (["--seed", str(2**64)], "--seed must be between")):
        result = runner.invoke(app, ["generate", "--model", str(tiny_dir), "-n", "8", "--steps", "8",
                                     "--block-length", "8", *args, "hi"])
        assert result.exit_code == 2 and message in result.stderr, (args, result.output)
    answers = []
    for steps in ("8", str(10**9)):
        result = runner.invoke(app, ["generate", "--model", str(tiny_dir), "-n", "8", "--steps", steps,
                                     "--block-length", "8", "--json", "hi"])
        assert result.exit_code == 0, result.output
        answers.append(json.loads(result.stdout)["answer"])
    assert answers[0] == answers[1]


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--policy", "bogus", "unknown policy 'bogus'; choose one of: none, full,"),
    ("--dtype", "float8", "--dtype: unknown dtype 'float8'; choose one of auto, float32, fp32, bfloat16, bf16,"),
    ("--temperature", "-1", "--temperature must be >= 0, got -1.0"),
    ("--threshold", "2", "--threshold must be in [0, 1), got 2.0"),
])
def test_a_bad_setting_stops_before_the_model_is_chosen(tmp_path, flag, value, message):
    """Without --model the embedded model would be chosen, with a note saying so: a bad value is refused first, in
    one line, as a usage error."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The special magic number for apple is 12345.\n")
    result = runner.invoke(app, ["ask", str(doc), "What is the number?", flag, value])
    assert result.exit_code == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "note:" not in result.output


def test_every_dtype_name_is_one_the_loader_maps():
    from maskkv_cli.defaults import DTYPE_NAMES
    from maskkv_cli.models.loading import DTYPES

    assert set(DTYPE_NAMES) == set(DTYPES)


@pytest.mark.parametrize("flag", ["--steps", "--gen-length", "--block-length"])
def test_a_zero_length_or_step_count_is_refused_not_read_as_the_default(tiny_dir, flag):
    result = runner.invoke(app, ["generate", "--model", str(tiny_dir), flag, "0", "hi"])
    assert result.exit_code == 2 and f"{flag} must be a positive integer, got 0" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_debug_shows_traceback(tmp_path):
    result = runner.invoke(app, ["--debug", "generate", "--model", str(tmp_path / "nope"), "hi"])
    assert result.exit_code != 0 and result.exception is not None


def test_policies_lists_all():
    """One row per registered policy, its name first, and only the paper's method marked as the default."""
    from maskkv_cli.policies.base import policy_names

    result = runner.invoke(app, ["policies"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.output.splitlines() if line.strip()}
    assert set(rows) == set(policy_names())
    for name in ("none", "full", "maskkv", "snapkv", "pyramidkv", "adakv", "streamingllm", "random",
                 "mask-vote-uniform", "prompt-vote", "all-vote"):
        assert name in rows
    assert [name for name, line in rows.items() if line.rstrip().endswith("[default]")] == ["maskkv"]
    listed = json.loads(runner.invoke(app, ["policies", "--json"]).stdout)["policies"]
    assert [p["name"] for p in listed] == policy_names()
    assert [p["name"] for p in listed if p["default"]] == ["maskkv"]
    assert {p["name"] for p in listed if not p["evicts"]} == {"none", "full"}


def test_the_papers_maskkv_is_the_default_and_maskkv_plus_is_labelled_experimental():
    from maskkv_cli.engine.plan import CacheConfig

    assert DEFAULT_POLICY == "maskkv" and CacheConfig().policy == "maskkv"
    lines = {line.split()[0]: line for line in runner.invoke(app, ["policies"]).output.splitlines() if line.strip()}
    assert lines["maskkv"].endswith("[default]")
    assert "[default]" not in lines["maskkv-plus"]
    assert "ours, experimental: tuned on the tiny model" in lines["maskkv-plus"]
    assert "maskkv bench quality --policies full,maskkv,maskkv-plus" in lines["maskkv-plus"]


def test_demo_runs_on_a_given_model(tiny_dir):
    result = runner.invoke(app, ["demo", "--model", str(tiny_dir), "--json", "--length", "120"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["question"].startswith("What is the special magic number for")
    assert [r["policy"] for r in data["runs"]] == [DEFAULT_POLICY, "full"]
    assert data["runs"][0]["budget"] == 16
    assert "\x1b" not in result.stdout
    assert data["load_s"] > 0 and data["warmup_s"] > 0  # one-time costs, apart from the timed runs
    shown = runner.invoke(app, ["demo", "--model", str(tiny_dir), "--length", "120"])
    assert shown.exit_code == 0, shown.output
    assert "timed after a warm-up run of each (" in shown.stdout and "one-time costs, not counted); model load" \
        in shown.stdout
    kv = [line.split(", KV ")[1] for line in shown.stdout.splitlines() if ", KV " in line]
    assert len(kv) == 2 and kv[0].endswith("x smaller)") and kv[1].endswith("(all kept)")  # nothing evicted: no "1.0x"


def test_demo_of_a_document_read_in_parts_says_so(tiny_dir):
    """It said "(2038 prompt tokens" for a text read in two overlapping parts (their prompts summed) beside the
    cache of one part ("KV ... of 8.0 MiB")."""
    shown = runner.invoke(app, ["demo", "--model", str(tiny_dir), "--length", "1200"])
    assert shown.exit_code == 0, shown.output
    match = re.search(r"\((\d+) tokens, read in (\d+) parts, a text from the package", shown.stdout)
    assert match and int(match.group(1)) > 1024 and int(match.group(2)) > 1, shown.stdout
    assert f"{match.group(2)} prompts of " in shown.stdout and " per part" in shown.stdout


def test_decode_drops_control_characters(tiny_tokenizer):
    from maskkv_cli.prompting import decode_answer

    ids = tiny_tokenizer.encode("a\x1bb\x07c", add_special_tokens=False)
    assert decode_answer(tiny_tokenizer, ids, set(), -1) == "abc"


@pytest.mark.parametrize("args", [
    ["batch", "--docs", "doc.txt", "--questions", "q.txt"], ["bench", "speed", "--config", "tiny"],
    ["bench", "memory", "--config", "tiny"], ["bench", "loading", "--config", "tiny"],
    ["bench", "quality", "--samples", "1"], ["train-tiny", "--steps", "1"],
])
@pytest.mark.parametrize("below", [False, True])
def test_a_results_folder_where_a_file_is_is_refused_first(tmp_path, monkeypatch, args, below):
    """--out naming a file (or a folder inside one) is one usage-error line before anything runs, not an OS error
    when the first result is written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text("The special magic number for apple is 12345.\n")
    (tmp_path / "q.txt").write_text("What is the number?\n")
    (tmp_path / "afile").write_text("kept\n")
    out = "afile/sub" if below else "afile"
    result = runner.invoke(app, [*args, "--out", out])
    assert result.exit_code == 2, result.output
    assert f"--out {out}: afile is a file, not a folder" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "note:" not in result.output
    assert (tmp_path / "afile").read_text() == "kept\n"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no folder can be made")
@pytest.mark.parametrize("args", [
    ["batch", "--docs", "doc.txt", "--questions", "q.txt"], ["bench", "speed", "--config", "tiny"],
    ["bench", "quality", "--samples", "1"],
])
def test_a_results_folder_that_cannot_be_made_is_refused_first(tmp_path, monkeypatch, args):
    """--out where no folder can be made (here under /proc) is one usage-error line before the model loads, not an
    OS error with a traceback hint once the run is about to write."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text("The special magic number for apple is 12345.\n")
    (tmp_path / "q.txt").write_text("What is the number?\n")
    result = runner.invoke(app, [*args, "--out", "/proc/maskkv-results/run"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == ("error: --out /proc/maskkv-results/run: cannot make the folder (No such file "
                                     "or directory); give another path")
    assert "note:" not in result.output


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no file can be made")
@pytest.mark.parametrize("option", ["--html", "--plot"])
def test_a_profile_report_where_no_file_can_be_written_is_refused_first(tmp_path, monkeypatch, option):
    """profile's --html / --plot in a folder that exists but takes no new file: one usage-error line before the
    model loads, not an OS error after every run."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text("The special magic number for apple is 12345.\n")
    result = runner.invoke(app, ["profile", "doc.txt", "What is the number?", option, "/proc/self/report.out"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().startswith(f"error: {option} /proc/self/report.out: no file can be written in "
                                            "/proc/self (")
    assert "note:" not in result.output


def test_an_unreadable_file_is_named_once_with_the_os_reason(tmp_path, monkeypatch):
    """The message names the file once and gives the OS's reason in its own words, not "[Errno 2] ...: 'path'"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text("The special magic number for apple is 12345.\n")
    result = runner.invoke(app, ["ask", "doc.txt", "--questions", "missing.txt"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: cannot read the questions file missing.txt: No such file or directory"


def test_profile_names_the_embedded_model_as_such(tmp_path, monkeypatch):
    """The report's header (terminal and HTML) calls the default model "the embedded tiny model", not its folder
    inside the installed package."""
    from maskkv_cli.paths import shipped_model_folder

    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text("The special magic number for apple is 12345.\n")
    result = runner.invoke(app, ["profile", "doc.txt", "What is the special magic number for apple?", "--policies",
                                 "full", "--html", "report.html"])
    assert result.exit_code == 0, result.output
    header = " ".join(result.stdout.split())  # the header may wrap at the terminal's width
    assert "model the embedded tiny model on cpu" in header
    assert str(shipped_model_folder()) not in header
    assert "model the embedded tiny model on cpu" in (tmp_path / "report.html").read_text()


def test_out_folder_removes_the_folders_it_made_to_find_out(tmp_path, monkeypatch):
    """The check makes the folders to see that it can, and removes them again: also the upper ones made before a
    lower one failed."""
    from pathlib import Path

    from maskkv_cli.cli.parsing import out_folder
    from maskkv_cli.errors import UsageError

    assert out_folder(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()
    made = Path.mkdir

    def fails_below_a(self: Path, *args: object, **kwargs: object) -> None:
        made(tmp_path / "a")
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as patched:
        patched.setattr(Path, "mkdir", fails_below_a)
        with pytest.raises(UsageError, match=r"cannot make the folder \(Permission denied\)"):
            out_folder(tmp_path / "a" / "b" / "c")
    assert not (tmp_path / "a").exists()
    (tmp_path / "kept").mkdir()
    assert out_folder(tmp_path / "kept") == tmp_path / "kept" and (tmp_path / "kept").is_dir()


@pytest.mark.parametrize("args", [
    ["ask", "doc.txt", "What is the number?"], ["profile", "doc.txt", "What is the number?"], ["serve"],
    ["batch", "--docs", "doc.txt", "--questions", "q.txt", "--out", "results"],
])
def test_an_unknown_long_mode_is_refused_first(tmp_path, monkeypatch, args):
    import maskkv_cli.server

    def serving(*args: object, **kwargs: object) -> None:
        pytest.fail("the server started")  # (it would serve until stopped)

    monkeypatch.setattr(maskkv_cli.server, "serve", serving)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text("The special magic number for apple is 12345.\n")
    (tmp_path / "q.txt").write_text("What is the number?\n")
    result = runner.invoke(app, [*args, "--long", "bogus"])
    assert result.exit_code == 2 and "--long must be one of parts, truncate, rope-scale, got 'bogus'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "note:" not in result.output
    assert not (tmp_path / "results").exists()


def test_ask_reads_a_questions_file_as_batch_does(tmp_path):
    """An empty file is refused (not silently nothing added), and a byte-order mark is not part of a question."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The special magic number for apple is 12345.\n")
    empty = tmp_path / "none.txt"
    empty.write_text("# only a comment\n\n")
    result = runner.invoke(app, ["ask", str(doc), "What is the number?", "--questions", str(empty)])
    assert result.exit_code == 2 and "holds no questions" in result.stderr
    marked = tmp_path / "q.txt"
    marked.write_bytes("\ufeffWhat is the special magic number for apple?\n".encode())
    result = runner.invoke(app, ["ask", str(doc), "--questions", str(marked), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["answers"][0]["question"] == "What is the special magic number for apple?"


def test_quiet_keeps_the_low_confidence_line_of_summarize_and_generate(tiny_dir, tmp_path):
    """docs/models.md: the LOW CONFIDENCE mark is part of the answer and --quiet keeps it; summarize and generate
    dropped it (ask kept it)."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The river runs past the old mill. The keeper writes every night. " * 6)
    for args in (["summarize", str(doc), "--length", "10"], ["generate", "Hello there", "-n", "8"]):
        loud = runner.invoke(app, [*args, "--model", str(tiny_dir)])
        quiet = runner.invoke(app, [*args, "--model", str(tiny_dir), "--quiet"])
        assert loud.exit_code == quiet.exit_code == 0, quiet.output
        assert "LOW CONFIDENCE" in loud.stderr  # the random test model guesses
        low = [line for line in loud.stderr.splitlines() if line.startswith("LOW CONFIDENCE")]
        assert low and low[0] in quiet.stderr.splitlines()


def test_summarize_with_a_length_that_leaves_too_little_room_names_the_longest_that_fits(tiny_dir, tmp_path):
    """It said "--length 100 leaves no room for the document in the 256-token window" and no more; a --length the
    parts had room for but the final pass over their summaries had not failed after every part had run."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The river runs past the old mill. The keeper writes every night. " * 200)
    result = runner.invoke(app, ["summarize", str(doc), "--length", "600", "--model", str(tiny_dir)])
    assert result.exit_code == 2, result.output
    found = re.search(r"error: --length 600 leaves \d+ tokens of the (\d+)-token window for the text beside the "
                      r"summary \(each part, and the final pass over the parts' summaries, need at least 64\): give "
                      r"at most --length (\d+)$", result.stderr.strip())
    assert found, result.stderr
    longest = found.group(2)
    doc.write_text("The river runs past the old mill. The keeper writes every night.")  # one part: quick
    fits = runner.invoke(app, ["summarize", str(doc), "--length", longest, "--model", str(tiny_dir), "--json"])
    assert fits.exit_code == 0, fits.output
    more = runner.invoke(app, ["summarize", str(doc), "--length", str(int(longest) + 1), "--model", str(tiny_dir)])
    assert more.exit_code == 2 and "give at most --length" in more.stderr
    # with --steps given, a shorter length whose blocks the steps do not divide is no length to offer (it was the
    # error of that length's steps instead)
    steps = runner.invoke(app, ["summarize", str(doc), "--length", "600", "--steps", "30", "--model", str(tiny_dir)])
    assert steps.exit_code == 2 and "give at most --length" in steps.stderr, steps.output
