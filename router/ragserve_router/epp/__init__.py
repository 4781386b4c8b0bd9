"""The router as a Gateway API Inference Extension endpoint picker (docs/gateway.md): Envoy's ext_proc protocol
served beside the HTTP gateway (--epp-port), deciding with the same routing (ragserve_router.routing)."""
