"""Every relative link in the README, the changelog and docs/ leads somewhere: to a file or
folder of the repository and, for ``#anchor``, to a heading of that page (GitHub's rules)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PAGES = sorted(
    p for p in [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "CONTRIBUTING.md",
                *(ROOT / "docs").glob("*.md")] if p.exists()
)

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
_HTML = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=\"([^\"]+)\"", re.IGNORECASE)
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:


def prose(text: str) -> str:
    """The page without code blocks and code spans, where a link is only an example."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    text = prose(text)
    return [m.group(1) for pattern in (_INLINE, _REFERENCE, _HTML)
            for m in pattern.finditer(text)]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lowercased, punctuation
    dropped (letters, digits, '_', '-' and spaces stay), each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    parts = re.split(r"(`+.+?`+)", re.sub(r"<[^>]+>", "", text))
    for i in range(0, len(parts), 2):  # emphasis, outside code spans; a_b_c is no emphasis
        parts[i] = re.sub(r"(\*\*|\*|(?<!\w)__|(?<!\w)_)(\S(?:.*?\S)?)\1(?!\w)", r"\2",
                          parts[i])
    text = "".join(parts).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, … as GitHub numbers them."""
    seen: Counter[str] = Counter()
    result: set[str] = set()
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        slug = anchor(heading)
        result.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return result


def test_the_anchor_rules_are_githubs() -> None:
    assert anchor("Reload without a restart") == "reload-without-a-restart"
    assert anchor("`routing.yaml`: keys & defaults") == "routingyaml-keys--defaults"
    assert anchor("What `max_wait_s` means (and why)") == "what-max_wait_s-means-and-why"
    assert anchor("**Failure behaviour**") == "failure-behaviour"
    assert anchors("# A\n\n## A\n\n```\n# not a heading\n```\n## A") == {"a", "a-1", "a-2"}


def test_links_are_found_outside_code_only() -> None:
    text = ("See [the page](docs/x.md#y), ![img](a.png) and [ref].\n\n[ref]: b.md\n"
            "`[not](c.md)`\n```\n[not](d.md)\n```\n<a href=\"e.md\">e</a> [web](https://x.org)")
    assert sorted(links(text)) == ["a.png", "b.md", "docs/x.md#y", "e.md", "https://x.org"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    broken: list[str] = []
    for target in links(text):
        if _EXTERNAL.match(target) or target.startswith("//"):
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment.lower() not in anchors(
                resolved.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading #{fragment} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"
