"""The chart README's values table, generated from values.yaml's `# --` comments.

    .cache/check-helm/venv/bin/python helm/tests/values_table.py          # print the table
    .cache/check-helm/venv/bin/python helm/tests/values_table.py --write  # update the README

test_chart.py checks that every key in values.yaml has a description and that
the README carries exactly the table this prints, so the two cannot drift.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

CHART_DIR = Path(__file__).resolve().parent.parent / "idempotency-service"
VALUES = CHART_DIR / "values.yaml"
README = CHART_DIR / "README.md"
START = "<!-- values-table:start -->"
END = "<!-- values-table:end -->"

KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w.-]*):(?P<rest>.*)$")


@dataclass
class Key:
    path: str
    description: str
    # A leaf has its value on its own line; a parent's children follow it.
    is_leaf: bool


def documented_keys(text: str) -> list[Key]:
    """Every key of values.yaml in order, with the `# --` comment above it."""
    keys: list[Key] = []
    stack: list[tuple[int, str]] = []
    comment: list[str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            comment = None
            continue
        if stripped.startswith("# --"):
            comment = [stripped[len("# --") :].strip()]
            continue
        if stripped.startswith("#"):
            if comment is not None:
                comment.append(stripped.lstrip("#").strip())
            continue
        match = KEY_LINE.match(line)
        if not match:
            # A list item or a continuation line of a value.
            comment = None
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match["key"]))
        rest = match["rest"].split(" #")[0].strip()
        keys.append(
            Key(
                path=".".join(name for _, name in stack),
                description=" ".join(comment or []).strip(),
                is_leaf=rest != "",
            )
        )
        comment = None
    return keys


def lookup(values: dict, path: str):
    node = values
    for part in path.split("."):
        node = node[part]
    return node


def type_name(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "object"
    return "null"


def table(values_text: str) -> str:
    values = yaml.safe_load(values_text)
    rows = [
        "| Key | Type | Default | Description |",
        "| --- | --- | --- | --- |",
    ]
    for key in documented_keys(values_text):
        if not key.is_leaf:
            continue
        value = lookup(values, key.path)
        default = json.dumps(value).replace("|", "\\|")
        description = key.description.replace("|", "\\|")
        rows.append(f"| `{key.path}` | {type_name(value)} | `{default}` | {description} |")
    return "\n".join(rows) + "\n"


def readme_with_table(readme_text: str, table_text: str) -> str:
    head, rest = readme_text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table_text}{END}{tail}"


def main() -> None:
    generated = table(VALUES.read_text())
    if sys.argv[1:] == ["--write"]:
        README.write_text(readme_with_table(README.read_text(), generated))
    else:
        sys.stdout.write(generated)


if __name__ == "__main__":
    main()
