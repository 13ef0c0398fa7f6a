"""ktlong: chat with a local LLM about very long documents, with block-sparse CPU attention."""

__version__ = "0.1.0"
