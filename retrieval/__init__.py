"""Document loading, chunking, embeddings and the FAISS index (arrives with the retrieval issue)."""
