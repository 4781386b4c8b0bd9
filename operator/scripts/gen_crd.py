"""Write the installable RAGServe CRD (ragserve_operator.crd) to the chart's crds/ and operator/deploy/.

python operator/scripts/gen_crd.py          # rewrite both copies
python operator/scripts/gen_crd.py --check  # exit 1 if one is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ragserve_operator.crd import crd_yaml

ROOT = Path(__file__).resolve().parents[2]
COPIES = [ROOT / "charts/ragserve/crds/ragserve.dev_ragserves.yaml", ROOT / "operator/deploy/01-crd.yaml"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a copy is stale")
    text = crd_yaml()
    stale = [path for path in COPIES if not path.is_file() or path.read_text() != text]
    if parser.parse_args().check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run python {Path(__file__).relative_to(ROOT)}", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
