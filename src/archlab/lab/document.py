"""A report as a list of blocks (headings, paragraphs, tables, images), rendered to Markdown and HTML by
archlab.lab.report; a suite's own analysis section (lab/scaling_report.py) returns blocks too."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Block:
    kind: str          # h1 h2 h3 p table img
    text: str = ""
    header: list[str] | None = None
    rows: list[list[str]] | None = None
