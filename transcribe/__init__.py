"""Fast offline batch speech-to-text: the CLI and the pipeline around the model."""
__version__ = "0.1.0"
