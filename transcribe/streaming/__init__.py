"""Streaming mode on the Parakeet engine: sessions (cache-aware: incremental features and the
trained chunking; offline-trained: rolling audio windows with left/right context), the
scheduler over one slot pool (`engines.stream_pool` / `engines.chunked_pool`), the TCP server
and its protocol."""
