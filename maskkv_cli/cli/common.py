"""What every command shares: the one place errors become messages (``guarded``), notes, the one-line run
statistics (the generation and cache settings built from the options are ``cli/run_options.py``)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from maskkv_cli.errors import MaskKVError


class State:
    debug: bool = False


F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = 1) -> typer.Exit:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    return typer.Exit(code)


def output_gone() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what is still buffered for a reader that
    has gone does not raise again at exit."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is no file (a test's capture)
        pass


def guarded(fn: F) -> F:
    """Translate errors into one line on stderr and an exit code; tracebacks only with ``--debug``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except MaskKVError as exc:
            if State.debug:
                raise
            raise fail(str(exc), exc.exit_code) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        except BrokenPipeError:  # the reader of the output has gone (``maskkv plan ... | head``): stop quietly
            output_gone()
            raise typer.Exit(141) from None  # as a shell reports a command stopped by SIGPIPE
        except Exception as exc:
            if State.debug:
                raise
            if type(exc).__name__ == "OutOfMemoryError":
                raise fail("the device ran out of memory; try a smaller --budget, --dtype bf16, a shorter "
                           "document, or --device cpu") from None
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise fail(f"{type(exc).__name__}: {first} (run with --debug for the traceback)") from None

    return wrapper  # type: ignore[return-value]


REPORT_WIDTH = 220  # the most columns a table written off a terminal (a file or a pipe) is laid out in


def report_console() -> Any:
    """The Rich console a command prints its tables on (stdout); print them with ``print_wide``."""
    from rich.console import Console

    return Console()


def print_wide(console: Any, renderable: Any) -> None:
    """Print ``renderable`` on ``console``. Off a terminal Rich lays a table out in 80 columns (or ``COLUMNS``) and
    cuts its cells to fit ("LOW 0.…", "716.0 K…"): there a table is laid out as wide as it needs, up to
    ``REPORT_WIDTH`` (text wraps at the width, losing nothing)."""
    from rich.table import Table

    if console.is_terminal or not isinstance(renderable, Table):
        console.print(renderable)
        return
    from rich.measure import Measurement

    needed = Measurement.get(console, console.options.update_width(REPORT_WIDTH), renderable).maximum
    width = console.width
    console.width = max(width, needed)  # (print's own width is capped at the console's)
    try:
        console.print(renderable)
    finally:
        console.width = width


def note(message: str | None, quiet: bool, as_json: bool) -> None:
    if message and not quiet and not as_json:
        sys.stderr.write(f"note: {message}\n")


# Notes about a model's setup that stay true from one command to the next (``engine.plan.resolve_importance``'s
# calibration notes): shown the first time on this machine only, not on every command.
ONCE = ("no calibration profile for this model", "using calibration profile")
NOTES_SHOWN = "notes-shown.json"


def note_once(message: str | None, quiet: bool, as_json: bool) -> None:
    """``note``, except that a note of ``ONCE`` is shown only the first time this exact message would be shown on
    this machine (remembered in ``MASKKV_HOME``); a store that cannot be read or written shows it again."""
    if not message or quiet or as_json:
        return
    if message.startswith(ONCE):
        import hashlib
        import json

        from maskkv_cli.paths import maskkv_home
        from maskkv_cli.runtime.fileio import atomic_write_text

        path = maskkv_home() / NOTES_SHOWN
        key = hashlib.sha256(message.encode()).hexdigest()[:16]
        try:
            shown = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
        except (OSError, ValueError):
            shown = []
        if not isinstance(shown, list):  # (a file of another shape: started afresh, as an unreadable one)
            shown = []
        if key in shown:
            return
        try:
            atomic_write_text(path, json.dumps([*shown, key]))
        except OSError:
            pass
    note(message, quiet, as_json)


def one_line_stats(stats: Any, prompts: int = 1) -> str:
    """A run's statistics in one line; ``prompts``: how many prompts it took (a document read in parts), whose
    prompt tokens, prefill and steps are summed and whose cache is the largest of one."""
    from maskkv_cli.cli.render import kv_saving
    from maskkv_cli.runtime.sizes import human_size

    kept, full = human_size(stats.kv_bytes, binary=True), human_size(stats.kv_full_bytes, binary=True)
    kv = f"KV {kept} of {full} {kv_saving(stats)}" if stats.kv_bytes else "no KV cache"
    if prompts > 1:
        kv = f"{kv} per part"
    prompt = f"{prompts} prompts of {stats.prompt_len} tokens in all" if prompts > 1 else \
        f"prompt {stats.prompt_len} tokens"
    quantized = getattr(stats, "quantization", "none")  # named only when quantized (the line is as before else)
    weights = (f", {quantized} weights {human_size(stats.weights_bytes, binary=True)}"
               if quantized != "none" else "")
    return (f"{stats.policy}: {prompt}, prefill {stats.prefill_s:.2f} s, "
            f"{stats.steps_run} steps, {stats.total_s:.2f} s, {stats.tokens_per_s:.1f} tokens/s, {kv}{weights}")


def live_display_on(quiet: bool, as_json: bool) -> bool:
    """A live display only when both stdout and stderr are terminals and the user wants neither quiet nor JSON."""
    return sys.stdout.isatty() and sys.stderr.isatty() and not quiet and not as_json
