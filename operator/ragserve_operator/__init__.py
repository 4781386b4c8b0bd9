"""The ragserve Kubernetes operator (kopf)."""
