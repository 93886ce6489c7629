"""The options ask, summarize, generate and profile share: declared once (cli/run_options.py), one value."""

from __future__ import annotations

import inspect

import pytest
from typer.testing import CliRunner

from maskkv_cli.cli import app
from maskkv_cli.cli.run_options import DECLARED, RunOptions, run_options

runner = CliRunner()


def test_every_shared_option_has_one_declaration_and_one_field():
    assert set(DECLARED) == {name for name in inspect.signature(RunOptions).parameters}
    for name, (_, default) in DECLARED.items():
        assert getattr(RunOptions(), name) == default


@pytest.mark.parametrize("command", ["ask", "summarize", "generate", "profile"])
def test_commands_take_the_shared_options(command):
    out = runner.invoke(app, [command, "--help"], terminal_width=200).stdout
    for flag in ("--model", "--temperature", "--seed", "--device", "--dtype", "--json", "--quiet"):
        assert flag in out, (command, flag)


def test_the_command_receives_one_value():
    seen: list[RunOptions] = []

    @run_options("policy", "budget", "seed")
    def command(text: str, *, opts: RunOptions) -> None:
        seen.append(opts)

    assert list(inspect.signature(command).parameters) == ["text", "policy", "budget", "seed"]
    command(text="x", policy="snapkv", budget=8, seed=3)
    assert seen == [RunOptions(policy="snapkv", budget=8, seed=3)]
    assert seen[0].cache().budget == 8 and seen[0].settings().seed == 3
    with pytest.raises(ValueError, match="not a shared option"):
        run_options("nope")


def test_a_bad_value_is_one_line_before_anything_loads(tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("Some text.")
    for args in (["--budget", "0"], ["--budget", "4", "--ratio", "0.5"], ["--layer-budgets", "x"]):
        result = runner.invoke(app, ["ask", str(doc), "Q?", *args])
        assert result.exit_code == 2 and result.output.count("\n") == 1 and "error:" in result.output, args


@pytest.mark.parametrize("command", ["generate", "ask", "profile"])
def test_generation_settings_that_do_not_go_together_fail_before_the_weights_load(tmp_path, monkeypatch, command):
    import maskkv_cli.app.session as session_module

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the settings were checked")

    monkeypatch.setattr(session_module, "load_checkpoint", no_load)
    doc = tmp_path / "d.txt"
    doc.write_text("Some text.")
    head = {"generate": ["generate", "Hello"], "ask": ["ask", str(doc), "Q?"], "profile": ["profile", str(doc)]}
    for args, message in ((["--gen-length", "7", "--block-length", "4"], "must be a multiple of --block-length 4"),
                          (["--gen-length", "16", "--block-length", "8", "--steps", "3"], "--steps 3 must be")):
        result = runner.invoke(app, [*head[command], *args, "--quiet"])
        assert result.exit_code == 2, (command, args, result.output)
        assert message in result.output and result.output.count("\n") == 1, (command, args, result.output)
    if command == "generate":  # its own sampler options are checked with them
        result = runner.invoke(app, ["generate", "Hello", "--cfg", "-1", "--quiet"])
        assert result.exit_code == 2 and "--cfg must be >= 0" in result.output


def test_summarize_checks_its_block_against_the_model_summary_length_before_the_weights_load(tmp_path, monkeypatch):
    import maskkv_cli.app.session as session_module

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the settings were checked")

    monkeypatch.setattr(session_module, "load_checkpoint", no_load)
    doc = tmp_path / "d.txt"
    doc.write_text("Some text.")
    result = runner.invoke(app, ["summarize", str(doc), "--block-length", "5", "--quiet"])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "--block-length 5: this model writes its summaries in 64 tokens" in result.output  # no --gen-length named


@pytest.mark.parametrize(("family", "taken", "refused"), [
    ("llada", dict(block_length=8, cfg_scale=1.0, remasking="random", threshold=0.5),
     dict(alg="origin", top_p=0.9, top_k=3, editing_threshold=0.5, max_post_steps=3)),
    ("llada_moe", dict(block_length=8, cfg_scale=1.0, remasking="random", threshold=0.5),
     dict(alg="origin", top_p=0.9, top_k=3, editing_threshold=0.5, max_post_steps=3)),
    ("dream", dict(alg="origin", top_p=0.9, top_k=3, temperature=0.5),
     dict(block_length=8, cfg_scale=1.0, remasking="random", threshold=0.5, editing_threshold=0.5, max_post_steps=3)),
    ("llada2", dict(block_length=8, threshold=0.5, top_p=0.9, top_k=3, editing_threshold=0.5, max_post_steps=3),
     dict(cfg_scale=1.0, remasking="random", alg="origin")),
])
def test_each_sampler_refuses_the_options_it_does_not_take(family: str, taken: dict, refused: dict) -> None:
    from maskkv_cli.app.run_settings import RunSettings
    from maskkv_cli.errors import UsageError

    RunSettings(**taken).check_family(family)  # what its loop reads
    for name, value in refused.items():  # what it would silently ignore
        flag = "--cfg" if name == "cfg_scale" else "--" + name.replace("_", "-")
        with pytest.raises(UsageError, match=f"^{flag} is not an option of the {family} sampler"):
            RunSettings(**{name: value}).check_family(family)
