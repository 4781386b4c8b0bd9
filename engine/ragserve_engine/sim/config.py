"""`ragserve sim-engine`'s own flags: how many engines and the cost model their steps sleep by."""

from __future__ import annotations

from dataclasses import dataclass

from ragserve.flags import FromArgs, option, positive_int


@dataclass
class SimConfig(FromArgs):
    count: int = option(1, "simulated engines in this process, on ports --port, --port+1, ...", "sim",
                        type=positive_int)  # fmt: skip
    prefill_tokens_per_s: float = option(2000.0, "simulated prefill speed", "sim", type=float)
    decode_base_s: float = option(0.032, "simulated decode step: fixed seconds per step", "sim", type=float)
    decode_seq_s: float = option(
        0.0006, "simulated decode step: seconds each decoding sequence adds", "sim", type=float
    )
    free_ports: bool = option(False, "each engine on a free port the OS picks (not --port + i)", "sim", negatable=False)
    urls_file: str | None = option(None, "write the engines' {engine_id: url} here (JSON) once listening", "sim")
