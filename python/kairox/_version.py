"""kairox's version, apart from the package's __init__ (which reaches the runtime binding)
so that any module can name it without importing the rest."""
__version__ = "0.1.0"
