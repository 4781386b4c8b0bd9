"""`ragserve operator`: run the RAGServe operator (kopf, in-process)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ragserve.flags import add_flag
from ragserve.logs import setup_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser, "--namespace", default=None, help="watch RAGServes in these namespaces (comma-separated; globs ok)"
    )
    add_flag(parser, "--all-namespaces", action="store_true", help="watch RAGServes in every namespace")
    add_flag(
        parser,
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="liveness endpoint URL, empty to disable",
    )
    add_flag(
        parser,
        "--metrics-address",
        default="0.0.0.0:9090",
        help="HOST:PORT to serve Prometheus /metrics on (reconciles, conflicts, scaling), empty to disable",
    )
    add_flag(parser, "--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then KUBECONFIG)")
    add_flag(parser, "--peering", default=None, help="kopf peering name to run several replicas (default: standalone)")
    add_flag(
        parser,
        "--retry-delay",
        type=float,
        default=15.0,
        help="seconds before a RAGServe the API refused part of (Degraded: ApplyFailed) is reconciled again",
    )
    add_flag(parser, "--verbose", action="store_true", help="debug logging")
    add_flag(
        parser, "--print-crd", action="store_true", help="print the CRDs (RAGServe, RAGServeEnginePool; YAML) and exit"
    )


def namespaces_of(args: argparse.Namespace) -> list[str]:
    namespaces = [n.strip() for n in (args.namespace or "").split(",") if n.strip()]
    if bool(namespaces) == bool(args.all_namespaces):
        raise ValueError("choose either --namespace NS[,NS...] or --all-namespaces")
    return namespaces


def run(args: argparse.Namespace) -> int:
    if args.print_crd:
        from ragserve_operator.crd import crds_yaml

        sys.stdout.write(crds_yaml())
        return 0
    namespaces = namespaces_of(args)
    if not args.retry_delay > 0:
        raise ValueError("--retry-delay must be positive")
    if args.kubeconfig:
        if not os.path.isfile(args.kubeconfig):
            raise FileNotFoundError(f"kubeconfig {args.kubeconfig} does not exist")
        os.environ["KUBECONFIG"] = args.kubeconfig  # read by kopf's login and by our client alike
    import kopf
    from kubernetes.config import ConfigException

    import ragserve_operator.handlers  # noqa: F401  (registers the handlers)
    from ragserve_operator.kube import Kube, load_config

    try:
        kube = Kube(load_config())
    except ConfigException as exc:
        raise ValueError(f"no Kubernetes API to talk to (not in a pod, no usable kubeconfig): {exc}") from exc

    setup_logging("debug" if args.verbose else "info")
    if args.metrics_address:
        from ragserve_operator.metrics import serve

        serve(args.metrics_address)
    logging.getLogger("httpx").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    kopf.run(
        clusterwide=args.all_namespaces,
        namespaces=namespaces,
        standalone=args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(kube=kube, retry_delay=args.retry_delay),
    )
    return 0
