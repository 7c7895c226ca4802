"""Sample package whose models hatch-aoti compiles into the wheel."""

__version__ = "0.1.0"
