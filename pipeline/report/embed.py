"""Plots inside the markdown, for readers that see only its text: the Prefect UI renders an
artifact's markdown in a page served over http, where neither a path relative to the run
directory nor a ``file://`` link resolves. Each plot becomes a ``data:`` URI of its PNG, scaled
to at most ``MAX_WIDTH`` pixels and quantised to 256 colours (line plots and heatmaps lose
nothing visible), so that an artifact stays small; ``report.md`` keeps its relative links."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Callable
from pathlib import Path

from PIL import Image

MAX_WIDTH = 800  # pixels
# ![alt](plot.png) with a relative target, or a list item linking one: "- [name](../x/loss.png)"
IMAGE = re.compile(r"!\[([^\]]*)\]\((?![a-z]+:)([^)\s]+\.png)\)")
LINK = re.compile(r"^- \[([^\]]*)\]\((?![a-z]+:)([^)\s]+\.png)\)$", re.MULTILINE)


def png_data_uri(path: Path, max_width: int = MAX_WIDTH) -> str:
    with Image.open(path) as image:
        image = image.convert("RGB")
        if image.width > max_width:
            image = image.resize((max_width, round(image.height * max_width / image.width)), Image.LANCZOS)
        buffer = io.BytesIO()
        image.quantize(colors=256).save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def embed_plots(markdown: str, folder: Path, uri: Callable[[Path], str] = png_data_uri) -> str:
    """``markdown`` with every relative PNG, an image or a list item linking one, as an inline
    image (paths relative to ``folder``; ``uri`` encodes one)."""
    markdown = LINK.sub(lambda m: f"- ![{m[1]}]({uri(folder / m[2])})", markdown)
    return IMAGE.sub(lambda m: f"![{m[1]}]({uri(folder / m[2])})", markdown)
