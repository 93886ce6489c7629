"""The one size formatter: decimal units for files and downloads, binary ones for memory (outputs pinned, since the
CLI's tables, JSON-free lines and goldens show them)."""

from __future__ import annotations

import pytest

from maskkv_cli.runtime.sizes import human_size


@pytest.mark.parametrize("n,decimal,binary", [
    (0, "0 B", "0 B"),
    (999, "999 B", "999 B"),
    (1000, "1.0 KB", "1000 B"),
    (1536, "1.5 KB", "1.5 KiB"),
    (5 * 2**20, "5.2 MB", "5.0 MiB"),
    (3 * 10**9, "3.0 GB", "2.8 GiB"),
    (2 * 10**12, "2.0 TB", "1.8 TiB"),
    (2**50, "1125.9 TB", "1024.0 TiB"),
])
def test_human_size(n: int, decimal: str, binary: str) -> None:
    assert human_size(n) == decimal
    assert human_size(n, binary=True) == binary
