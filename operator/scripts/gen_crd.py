"""Write the installable CRDs (ragserve_operator.crd) to the chart's crds/ and operator/deploy/.

python operator/scripts/gen_crd.py          # rewrite every copy
python operator/scripts/gen_crd.py --check  # exit 1 if one is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ragserve_operator.crd import crd, crd_yaml, crds_yaml, pool_crd

ROOT = Path(__file__).resolve().parents[2]
CHART_CRDS = ROOT / "charts/ragserve/crds"


def copies() -> dict[Path, str]:
    """Each generated file and its text: one file per CRD in the chart (Helm installs crds/ as is), both in one
    file for `kubectl apply -f operator/deploy/`."""
    out = {
        CHART_CRDS / f"{c['spec']['group']}_{c['spec']['names']['plural']}.yaml": crd_yaml(c)
        for c in (crd(), pool_crd())
    }
    out[ROOT / "operator/deploy/01-crd.yaml"] = crds_yaml()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a copy is stale")
    stale = {path: text for path, text in copies().items() if not path.is_file() or path.read_text() != text}
    if parser.parse_args().check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run python {Path(__file__).relative_to(ROOT)}", file=sys.stderr)
        return 1 if stale else 0
    for path, text in stale.items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
