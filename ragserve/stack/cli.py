"""`ragserve up`: flags (cheap to import) and the foreground run with clean Ctrl-C/SIGTERM shutdown."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import threading
from pathlib import Path

from ragserve.engine_args import add_engine_arguments
from ragserve.flags import add_flag, parse_bytes, positive_int
from ragserve.logs import LOG_LEVELS
from ragserve.router_args import POLICIES
from ragserve.stack.config import default


def _setting(g, flag: str, help: str, **kwargs) -> None:
    """A flag for the StackConfig field of its name, with that field's default."""
    add_flag(g, flag, default=default(flag[2:].replace("-", "_")), help=help, **kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("stack")
    _setting(g, "--engines", "number of engine processes", type=positive_int)
    _setting(g, "--embedding-engines", "embedding engines (--task embed) for /v1/embeddings, /v1/rerank", type=int)
    _setting(g, "--embedding-model", "the embedding engines' model (alias or encoder/decoder directory)")
    _setting(g, "--host", "router bind address (the rest stays on 127.0.0.1)")
    _setting(g, "--port", "router HTTP port (0: a free port)", type=int)
    _setting(g, "--policy", "routing policy", choices=POLICIES)
    _setting(g, "--redis", "auto (start redis-server if installed), off, or a redis:// URL")
    add_flag(g, "--no-cachestore", action="store_true", help="run without the shared KV-block store")
    _setting(g, "--cachestore-memory", "cachestore RAM tier", type=parse_bytes)
    _setting(g, "--engine-threads", "torch threads per engine (0: cores / engines)", type=int)
    add_flag(g, "--engine-arg", action="append", help="extra flag for every engine, e.g. --engine-arg=--seed=1")
    add_flag(g, "--router-arg", action="append", help="extra router flag, e.g. --router-arg=--work-weight=1")
    add_flag(g, "--cachestore-arg", action="append", help="extra cachestore flag, e.g. --cachestore-arg=--workers=4")
    _setting(g, "--log-level", "log level of every process", choices=LOG_LEVELS)
    _setting(g, "--otlp-traces-endpoint", "OTLP/gRPC collector for every process's traces")
    _setting(g, "--tls-ca", "with --tls-cert/--tls-key: CA for mutual TLS on every gRPC link (registry, cachestore)")
    _setting(g, "--tls-cert", "certificate (PEM) the registry and the cachestore serve and every client presents")
    _setting(g, "--tls-key", "private key (PEM) of --tls-cert")
    add_flag(g, "--logs", action=argparse.BooleanOptionalAction, default=True, help="stream the processes' logs")
    _setting(g, "--ready-timeout", "seconds to wait for everything to be ready", type=float)
    _setting(g, "--grace", "seconds between SIGTERM and SIGKILL on shutdown", type=float)
    add_flag(g, "--state-file", default=None, help="write URLs and PIDs as JSON here once ready")
    add_flag(g, "--monitoring", action="store_true", help="also start a local Prometheus scraping the stack")
    add_flag(g, "--monitoring-interval", default="5s", help="with --monitoring: Prometheus scrape interval")
    add_flag(g, "--monitoring-rules", action="append", help="with --monitoring: a Prometheus rule file to load")
    g = parser.add_argument_group("demo")
    add_flag(g, "--demo", action="store_true", help="run `ragserve demo` against the stack once it is ready")
    add_flag(g, "--exit-after-demo", action="store_true", help="with --demo: stop the stack when the demo ends")
    add_flag(g, "--demo-args", default="", help="extra `ragserve demo` flags, one shell-quoted string")
    add_engine_arguments(parser)  # engine flags (--num-gpu-blocks, --max-model-len, ...) go to every engine


def run(args: argparse.Namespace) -> int:
    from ragserve.model_source import resolve_model
    from ragserve.stack.banner import banner
    from ragserve.stack.config import StackConfig
    from ragserve.stack.process import Child, ChildSpec, LogSink
    from ragserve.stack.spec import port_in_use, ragserve
    from ragserve.stack.supervisor import Stack, StackError, child_env

    cfg = StackConfig.from_args(args)
    model_name = resolve_model(cfg.model, cfg.served_model_name).name  # unknown models fail here
    if cfg.embedding_engines:
        resolve_model(cfg.embedding_model)
    if cfg.port and port_in_use(cfg.host, cfg.port):
        raise ValueError(f"port {cfg.port} on {cfg.host} is in use: pick another --port (0: any free port)")
    demo_argv = shlex.split(args.demo_args)
    stack = Stack(cfg, LogSink(show=args.logs))
    stop = threading.Event()
    _on_signals(stop, stack)
    code = 0
    try:
        if not stack.start(stop):
            return 130
        if args.monitoring:
            from ragserve.stack.monitoring import start_monitoring

            start_monitoring(stack, args.monitoring_interval, stop, args.monitoring_rules or [])
        stack.sink.say(banner(stack, model_name))
        if args.state_file:
            Path(args.state_file).write_text(json.dumps(stack.state(), indent=2))
        if args.demo or args.exit_after_demo:
            embed = ["--embedding-model", stack.embedding_model_name] if stack.embedding_model_name else []
            argv = ragserve("demo", "--url", stack.url, "--model", model_name, *embed, *demo_argv)
            demo = Child(ChildSpec("demo", argv, ""), stack.sink, 0, False)
            demo.start(child_env())
            code = _watch_demo(stack, demo, stop, args.exit_after_demo)
        else:
            stack.watch(stop)
    except StackError as exc:
        stack.say(f"error: {exc}")
        code = 1
    finally:
        stack.stop()
    return code


def _watch_demo(stack, demo, stop: threading.Event, exit_after: bool) -> int:
    """Serve on after the demo unless exit_after; a failed demo is reported, serving goes on."""
    from ragserve.stack.process import stop_all

    reported = False
    try:
        while not stop.wait(0.25):
            stack.check_alive(ignore=(demo,))
            code = demo.poll()
            if code is None or reported:
                continue
            stack.say(f"demo finished with exit code {code}" + ("" if exit_after else "; still serving (Ctrl-C stops)"))
            if exit_after:
                return code
            reported = True
    finally:
        stop_all([demo], 5.0, stack.say)
    return 0


def _on_signals(stop: threading.Event, stack) -> None:
    def handler(sig: int, _frame) -> None:
        if stop.is_set():  # second Ctrl-C: no more grace
            stack.kill()
            return
        stack.say(f"{signal.Signals(sig).name}: shutting down (again to kill at once)")
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
