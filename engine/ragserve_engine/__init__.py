"""The ragserve inference engine (torch). Import submodules directly; this file stays light."""
