"""`ragserve demo`: a small RAG client (offline embeddings, retrieval, chat through the router)."""

from ragserve.demo.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
