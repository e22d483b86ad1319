"""Models the worker builds itself: the tiny local Llama that tests and the demo serve (no model hub)."""

from kvfleet.worker.model.tiny import TINY, TinyModelError, TinySpec, make_tiny

__all__ = ["TINY", "TinyModelError", "TinySpec", "make_tiny"]
