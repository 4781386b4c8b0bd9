"""Components live in top-level folders (DESIGN.md) but import as ragserve.<component>."""

from setuptools import find_packages, setup

FOLDERS = {
    "ragserve": "ragserve",
    "ragserve.engine": "engine",
    "ragserve.router": "router",
    "ragserve.cachestore": "cachestore",
    "ragserve_operator": "operator/ragserve_operator",
}
packages = [sub for pkg, folder in FOLDERS.items() for sub in [pkg, *(f"{pkg}.{p}" for p in find_packages(folder))]]
setup(
    packages=packages,
    package_dir=FOLDERS,
    package_data={"ragserve_operator": ["*.yaml"], "ragserve": ["data/*", "data/corpus/*.md"]},
)
