"""ragserve: a Kubernetes-native serving stack for retrieval-augmented generation."""

__version__ = "0.1.0"
