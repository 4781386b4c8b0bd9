"""The README and docs/*.md: every relative link resolves, and every benchmark number is in its result file.

Links are checked as GitHub renders them: a path relative to the page (a file or a folder), optionally
with a `#heading` anchor slugged GitHub's way. Code spans and fenced blocks are not links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.M)


def prose(text: str) -> str:
    """The text without fenced blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    assert broken_links(page) == []


def test_slug_matches_github():
    assert slug("KV cache dtypes: `--kv-cache-dtype auto|int8`") == "kv-cache-dtypes---kv-cache-dtype-autoint8"
    assert slug("Cluster benchmark (`rag_cluster.py`)") == "cluster-benchmark-rag_clusterpy"


def benchmark_rows() -> list[list[str]]:
    """The README's benchmark table: cells of each row that links a result file."""
    section = ROOT.joinpath("README.md").read_text().split("\n## Benchmarks\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row] for row in rows if "bench/results/" in row[-1]]


def test_readme_has_one_benchmark_table_covering_every_baseline():
    baselines = " ".join(row[0] for row in benchmark_rows())
    for name in ("HF transformers", "llama.cpp", "round_robin", "recompute"):
        assert name in baselines


@pytest.mark.parametrize("row", benchmark_rows(), ids=lambda r: f"{r[0]}: {r[1]}")
def test_readme_benchmark_numbers_are_in_the_linked_result_file(row: list[str]):
    _, _, ours, theirs, ratio, link = row
    result = ROOT / re.search(r"\((bench/results/[^)]+)\)", link).group(1)
    text = result.read_text()
    found = ours in text and theirs in text
    assert found, f"{ours} / {theirs} not both in {result.name}"
    value = float(ratio.strip("*x"))
    quotients = {round(float(ours) / float(theirs), 2), round(float(theirs) / float(ours), 2)}
    in_file = f"| {value:.2f} |" in text or f"{value:.1f}x" in text  # the file's own ratio
    assert value in quotients or in_file, f"{ratio} is neither {ours} / {theirs} nor in {result.name}"


def test_readme_ragserve_example_is_a_valid_spec():
    from ragserve_operator.spec import validated  # the operator's own schema and cross-field rules

    block = re.search(r"```yaml\n(.*?)```", ROOT.joinpath("README.md").read_text(), re.S).group(1)
    resource = yaml.safe_load(block)
    assert (resource["apiVersion"], resource["kind"]) == ("ragserve.dev/v1alpha1", "RAGServe")
    validated(resource["spec"])
