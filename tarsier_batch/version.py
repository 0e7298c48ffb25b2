"""The package version, in a module of its own: the package's __init__ and the modules it exports both need
it, and importing it from the package would make them import each other."""

__version__ = "0.1.0"
