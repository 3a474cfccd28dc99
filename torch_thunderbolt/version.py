"""The package's version, in a module of its own at the bottom: set-up records and topology records name it
without importing the package's `__init__`, which registers the backend (and so imports everything)."""
__version__ = "0.1.0"
