"""docs/ stays true to the code: each adapter's patch reference in docs/releases/<adapter>.md is the block generated
from its specs (the one place a patch's why / how / upstream / remove-when is written), and nothing in the product
or its docs points at files outside this repository."""

import os
import re

import pytest

from zb_patch import versions as V
from zb_patch.cli import SHARED_PAGE, patches_markdown, shared_patches_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = re.compile(r"<!-- patches:begin -->\n(.*?)<!-- patches:end -->", re.S)


def _block(page: str) -> str:
    path = os.path.join(ROOT, "docs", "releases", page)
    with open(path, encoding="utf-8") as fh:
        blocks = BLOCK.findall(fh.read())
    assert len(blocks) == 1, f"{path}: needs exactly one <!-- patches:begin --> ... <!-- patches:end --> block"
    return blocks[0]


@pytest.mark.parametrize("adapter_id", [a.id for a in V.adapters()])
def test_patch_reference_is_generated(adapter_id):
    assert _block(f"{adapter_id}.md") == patches_markdown(adapter_id), (
        f"regenerate: zb-patch patches --markdown --adapter {adapter_id}"
    )


def test_shared_patch_texts_are_generated():
    assert _block(SHARED_PAGE) == shared_patches_markdown(), "regenerate: zb-patch patches --markdown --shared"


def test_no_docs_page_is_too_long():
    """Reference pages stay readable: none over 40,000 characters, all of docs/ under 213,000."""
    sizes = {}
    for d, _, files in os.walk(os.path.join(ROOT, "docs")):
        for f in files:
            if f.endswith(".md"):
                with open(os.path.join(d, f), encoding="utf-8") as fh:
                    sizes[os.path.relpath(os.path.join(d, f), ROOT)] = len(fh.read())
    assert {p: n for p, n in sizes.items() if n > 40_000} == {}
    assert sum(sizes.values()) < 213_000, sorted(sizes.items(), key=lambda kv: -kv[1])


def _texts():
    for top in ("zb_patch", "docs", "README.md", "CONTRIBUTING.md"):
        path = os.path.join(ROOT, top)
        files = (
            [path]
            if os.path.isfile(path)
            else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith((".py", ".md"))]
        )
        for f in files:
            with open(f, encoding="utf-8") as fh:
                yield os.path.relpath(f, ROOT), fh.read()


def test_no_references_outside_the_repository():
    outside = re.compile(r"\.\./shared|shared/reference|shared/design|blueprint\.md|\bA-[ab]\d+\b")
    hits = [f"{name}: {m.group(0)}" for name, text in _texts() for m in outside.finditer(text)]
    assert not hits, hits
