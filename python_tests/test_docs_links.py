"""The documentation's relative links and images point at files that exist, and their #anchors at real headings.

Checked: README.md, BENCHMARKS.md and every docs/*.md. A link or image `[text](target)` / `![alt](target)` whose
target is relative (not http(s)://, mailto: or another scheme) must name a file that exists, relative to the folder of
the markdown file that holds it; a target with `#anchor` (or only `#anchor`, the same file) must match a heading of
the target file by GitHub's slug rule. Links inside fenced code blocks are not links and are skipped.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200

# [text](target) or ![alt](target); the text may run over several lines of a paragraph but holds no "]".
LINK = re.compile(r"(!?)\[([^\]]*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def markdown_files():
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def without_fenced_code(text):
    """The text with every line of a fenced code block (fences included) blanked, so line numbers stay."""
    lines, fence = [], None
    for line in text.split("\n"):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            lines.append("")
        elif fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = None
            lines.append("")
        else:
            lines.append(line)
    return "\n".join(lines)


def find_links(text):
    """(line number, is image, text, target) of every markdown link and image outside fenced code blocks."""
    prose = without_fenced_code(text)
    return [
        (prose.count("\n", 0, m.start()) + 1, m.group(1) == "!", " ".join(m.group(2).split()), m.group(3))
        for m in LINK.finditer(prose)
    ]


def is_relative(target):
    return bool(target) and not SCHEME.match(target) and not target.startswith("//")


def github_slug(heading):
    """GitHub's anchor for a heading's text: markup dropped, lowercased, every character that is not a letter, digit,
    space, hyphen or underscore removed, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading counts by its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path):
    """Every anchor a markdown file offers: its headings' slugs (a repeated slug gets -1, -2, ...) and HTML anchors."""
    text = path.read_text(encoding="utf-8")
    found, seen = set(), {}
    for line in without_fenced_code(text).split("\n"):
        match = HEADING.match(line)
        if match:
            slug = github_slug(match.group(2))
            if slug in seen:
                seen[slug] += 1
                slug = f"{slug}-{seen[slug]}"
            else:
                seen[slug] = 0
            found.add(slug)
    found.update(HTML_ANCHOR.findall(text))
    return found


def relative_links():
    cases = []
    for path in markdown_files():
        if not path.exists():
            continue
        for line, _image, _text, target in find_links(path.read_text(encoding="utf-8")):
            if is_relative(target):
                name = path.relative_to(ROOT).as_posix()
                cases.append(pytest.param(path, target, id=f"{name}:{line}:{target}"))
    return cases


@pytest.mark.parametrize("source, target", relative_links())
def test_relative_link_resolves(source, target):
    file_part, _, anchor = target.partition("#")
    destination = (source.parent / file_part).resolve() if file_part else source
    assert destination.exists(), f"{source.relative_to(ROOT)}: {target!r} names a file that does not exist"
    if anchor:
        assert destination.suffix == ".md", (
            f"{source.relative_to(ROOT)}: {target!r} has an anchor into a non-markdown file"
        )
        offered = anchors(destination)
        assert anchor in offered, (
            f"{source.relative_to(ROOT)}: {target!r}: no heading of {destination.relative_to(ROOT)} has the slug "
            f"{anchor!r}; its slugs: {sorted(offered)}"
        )


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the reference belongs in docs/"


def test_link_finder_finds_the_readmes_links():
    """Guards against a finder that finds nothing, which would make the parametrized test pass vacuously."""
    readme = [t for _, _, _, t in find_links((ROOT / "README.md").read_text(encoding="utf-8")) if is_relative(t)]
    assert len(readme) >= 5, f"only {len(readme)} relative links found in README.md: {readme}"
    assert any(t.startswith("docs/") for t in readme)
    assert len(relative_links()) >= len(readme)


def test_link_finder_and_slugs_on_known_text():
    text = "\n".join(
        [
            "See [the API](ops.md#api) and ![a picture](demo_memory.png), [a link over",
            "two lines](#x), [out](https://example.com) and <https://example.com>.",
            "```",
            "[in a code block](nowhere.md)",
            "```",
            "`code` then [last](#last-one).",
        ]
    )
    assert find_links(text) == [
        (1, False, "the API", "ops.md#api"),
        (1, True, "a picture", "demo_memory.png"),
        (1, False, "a link over two lines", "#x"),
        (2, False, "out", "https://example.com"),
        (6, False, "last", "#last-one"),
    ]
    assert not is_relative("https://example.com") and not is_relative("mailto:a@b.c")
    assert is_relative("docs/apply.md#options") and is_relative("#options")
    assert github_slug("What apply() checks before it replaces a forward or a loss") == (
        "what-apply-checks-before-it-replaces-a-forward-or-a-loss"
    )
    assert github_slug("Packed and padded batches: no `[T, T]` mask") == "packed-and-padded-batches-no-t-t-mask"
    assert github_slug("`linear_cross_entropy_tile`") == "linear_cross_entropy_tile"
    assert github_slug("torch.compile of an applied model") == "torchcompile-of-an-applied-model"
    assert github_slug("apply()'s defaults") == "applys-defaults"
    assert github_slug("Key/value caches") == "keyvalue-caches"


def test_repeated_headings_get_numbered_anchors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Notes\n\n## Setup\n\n## Setup\n\n```\n## Setup\n```\n\n## Setup\n", encoding="utf-8")
    assert anchors(page) == {"notes", "setup", "setup-1", "setup-2"}
