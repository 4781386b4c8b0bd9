"""Shared fixtures. Servers bind to 127.0.0.1 on free ports and are stopped by the test."""

import os
import sys

import pytest

from tests.helpers.net import free_port
from tests.helpers.schedule import unit_of
from tests.helpers.threads import share_cores
from tests.helpers.triton_interpret import interpret_triton_language

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engine processes the tests start run eager (no inductor compile at start-up or in the background): a
# compiling engine takes ~12 s to be ready instead of ~3 s and keeps a core busy afterwards. The compiled
# paths have their own tests, which pass --no-enforce-eager (the flag beats this default).
os.environ.setdefault("RAGSERVE_ENFORCE_EAGER", "1")
# Bytecode is written: the servers and CLIs the tests start (hundreds of processes) then load torch, transformers and
# the rest from .pyc files that the first one wrote, instead of compiling every module they import from source each
# time. `make install` installs with --no-compile, so with PYTHONDONTWRITEBYTECODE=1 in the environment (as on CI's
# machines) nothing ever wrote one: an engine took ~5 s to import what it imports in ~2 s from .pyc files.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False  # this process's own later imports (torch's, once per xdist worker) too
share_cores()
interpret_triton_language()  # before torch's inductor can import triton compiled (see the function)
if "torch" in sys.modules:  # imported before this file (no plugin does today): it read the old setting
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_INTERPRET=1 for one test of the interpreted Triton kernels (tests.helpers.triton_interpret)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def pytest_xdist_make_scheduler(config: pytest.Config, log) -> object:
    """Under `make test`'s xdist workers a module is one unit of work, so its module fixtures start once, and
    each of WHOLE_DIRECTORIES is one unit (tests.helpers.schedule). (A scheduler rather than xdist_group marks:
    xdist 3.8 puts the group into item._nodeid, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleOrDirectory(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ModuleOrDirectory(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test marked last_in_module runs after the rest of its module in any order (pytest-randomly's too):
    it ends what the module's fixtures share, e.g. stops the module's stack."""
    for item in [i for i in items if i.get_closest_marker("last_in_module")]:
        items.remove(item)
        same = [k for k, other in enumerate(items) if other.path == item.path]
        items.insert(same[-1] + 1 if same else len(items), item)
