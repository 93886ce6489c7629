"""Record the golden outputs (tests/golden/*.json) from the code as it is: ``python tests/golden/record.py``.

It prints every value that moves against the files it replaces (``--check`` prints them and writes nothing), so
a re-recording shows exactly which cases a change moved; say why in the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from golden_cases import GOLDEN_DIR, record_all  # noqa: E402
from golden_diff import moved_paths  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="print what would move, write nothing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MASKKV_HOME"] = str(Path(tmp) / "home")
        os.environ["MASKKV_CONFIG"] = str(Path(tmp) / "config.toml")
        os.environ.pop("MASKKV_MODEL", None)
        data = json.loads(json.dumps(record_all(Path(tmp)), sort_keys=True))
    for name, value in data.items():
        path = GOLDEN_DIR / f"{name}.json"
        old = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        moved = moved_paths(old, value)
        print(f"{path.name}: {len(moved)} value(s) moved")
        for line in moved:
            print(f"  {line}")
        if moved and not args.check:
            path.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
