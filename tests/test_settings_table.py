"""Every GMLX_* setting gmlx/config.py reads is a row of the README's settings table, and the
table is one table: a blank line inside it once left its last rows as plain text."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Set by gmlx itself for the processes it starts, never by a user.
INTERNAL = {"GMLX_BLAS_CORE_CHOSEN"}


def settings_read() -> set[str]:
    return set(re.findall(r'"(GMLX_[A-Z0-9_]+)"', (REPO / "gmlx" / "config.py").read_text())) - INTERNAL


def table_blocks() -> list[list[str]]:
    """The README's runs of consecutive table lines that hold a GMLX_* row."""
    blocks, block = [], []
    for line in (REPO / "README.md").read_text().splitlines() + [""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if any(row.startswith("| `GMLX_") for row in block):
            blocks.append(block)
        block = []
    return blocks


def test_every_setting_is_a_row_of_one_readme_table():
    blocks = table_blocks()
    assert len(blocks) == 1, [block[0][:60] for block in blocks]
    header, rule, *rows = blocks[0]
    assert re.fullmatch(r"\|[-| :]+\|", rule), rule  # a header and its rule, so it renders as a table
    documented = {m.group(1) for row in rows if (m := re.match(r"\| `(GMLX_[A-Z0-9_]+)`", row))}
    assert settings_read() - documented == set()
    assert settings_read(), "no settings found: the reader's pattern no longer matches config.py"
