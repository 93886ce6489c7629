"""``python -m maskkv_cli.evaluation ARGS``: the harness's command line (``lm_eval ARGS``) with ``--model maskkv``.

Example: ``accelerate launch -m maskkv_cli.evaluation --model maskkv --model_args policy=maskkv,budget=256
--tasks longbench_hotpotqa``.
"""

from __future__ import annotations

import sys


def main() -> None:
    from maskkv_cli.evaluation import INSTALL_HINT, harness_available, register

    if not harness_available():
        sys.stderr.write(f"error: {INSTALL_HINT}\n")
        raise SystemExit(1)
    register()
    from lm_eval.__main__ import cli_evaluate

    from maskkv_cli.evaluation.harness_model import finish_distributed

    cli_evaluate()
    finish_distributed()


if __name__ == "__main__":
    main()
