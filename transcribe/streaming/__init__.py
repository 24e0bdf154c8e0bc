"""Streaming mode on the Parakeet engine: sessions (incremental features, chunking), the
scheduler over one slot pool (`engines.stream_pool`), the TCP server and its protocol."""
