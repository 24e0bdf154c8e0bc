"""Models and how they run: checkpoints, encoders, decoders, tokenizers."""
