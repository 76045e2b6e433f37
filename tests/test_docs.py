"""Every link into a Markdown heading (``file.md#anchor`` or ``#anchor``) in the README, the
changelog, docs/ and benchmarks/ names a heading that exists (GitHub's anchors: lower case,
punctuation but ``-`` and ``_`` dropped, spaces as ``-``, repeats numbered). The performance
notes cross-link hundreds of sections; a renamed heading would leave dead links silently."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set:
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # (a '#' line in a code block is no heading)
    seen, out = {}, set()
    for m in re.finditer(r"^#{1,6} (.*)$", text, re.M):
        a = _anchor(m.group(1))
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def _markdown_files():
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    files += sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "benchmarks").rglob("*.md"))
    return [f for f in files if f.exists()]


def _dead_links(files):
    """(links to missing headings, links checked) over ``files``."""
    anchors = {f.resolve(): _anchors(f.read_text()) for f in files}
    dead, checked = [], 0
    for f in files:
        for m in re.finditer(r"\]\(([^)\s#]*)#([^)\s]+)\)", f.read_text()):
            target = (f.parent / m.group(1)).resolve() if m.group(1) else f.resolve()
            if target not in anchors:
                continue  # (a link into a file that is not Markdown checked here)
            checked += 1
            if m.group(2) not in anchors[target]:
                dead.append(f"{f.name}: {m.group(0)}")
    return dead, checked


def test_heading_links_resolve():
    files = _markdown_files()
    assert len(files) >= 5, files  # (the README, the changelog and docs/ at least)
    dead, checked = _dead_links(files)
    assert checked > 100, checked
    assert not dead, "links to headings that do not exist:\n" + "\n".join(dead)


def _dead_references(files):
    """(references ``docs/<note>.md#<anchor>`` in ``files``' text, code comments and docstrings
    included, to missing headings; references checked)."""
    anchors, dead, checked = {}, [], 0
    for f in files:
        for m in re.finditer(r"\b(docs/[\w/.-]+?\.md)#([\w-]+)", f.read_text()):
            target = ROOT / m.group(1)
            if not target.exists():
                dead.append(f"{f.relative_to(ROOT)}: {m.group(0)} (no such file)")
                continue
            if target not in anchors:
                anchors[target] = _anchors(target.read_text())
            checked += 1
            if m.group(2) not in anchors[target]:
                dead.append(f"{f.relative_to(ROOT)}: {m.group(0)}")
    return dead, checked


def test_references_from_the_code_resolve():
    """The sources cite the performance notes by path and anchor (``docs/performance/
    backward.md#...`` in comments, docstrings and the changelog): each names a heading."""
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    for d in ("src", "tests", "benchmarks", "opcheck", "examples"):
        for ext in ("*.py", "*.sh", "*.md"):
            files += sorted((ROOT / d).rglob(ext))
    dead, checked = _dead_references([f for f in files if f.exists()])
    assert checked > 100, checked
    assert not dead, "references to headings that do not exist:\n" + "\n".join(dead)


def test_dead_link_found(tmp_path):
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    a.write_text("# Top\n[ok](#top) [ok](b.md#two-cta-h--128) [dead](b.md#gone) [dead](#nowhere)\n")
    b.write_text("## Two-CTA, H = 128\n")
    dead, checked = _dead_links([a, b])
    assert checked == 4 and dead == ["a.md: ](b.md#gone)", "a.md: ](#nowhere)"]


def test_anchor_rules():
    assert _anchor("Two-CTA clusters at H = 128 (not kept)") == "two-cta-clusters-at-h--128-not-kept"
    assert (_anchor("The 576/512 layout in the Gluon main kernel")
            == "the-576512-layout-in-the-gluon-main-kernel")
    assert _anchors("# A\n## A\n```\n# B\n```\n") == {"a", "a-1"}
