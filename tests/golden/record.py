"""Record the golden outputs (tests/golden/*.json) from the code as it is: ``python tests/golden/record.py``."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from golden_cases import GOLDEN_DIR, record_all  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MASKKV_HOME"] = str(Path(tmp) / "home")
        os.environ["MASKKV_CONFIG"] = str(Path(tmp) / "config.toml")
        os.environ.pop("MASKKV_MODEL", None)
        data = record_all(Path(tmp))
    for name, value in data.items():
        path = GOLDEN_DIR / f"{name}.json"
        path.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
