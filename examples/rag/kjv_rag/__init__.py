"""Retrieval-augmented question answering over the King James Bible on aieng: verse-window
chunks, embeddings through aieng, Qdrant (embedded, on disk) beside BM25, and a pipeline of
typed steps that each degrade on their own (see ../README.md)."""
