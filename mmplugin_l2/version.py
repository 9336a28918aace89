"""The package version: the one place it is written (setup.py reads it from here)."""
__version__ = '0.2.0'
version_info = tuple(int(x) for x in __version__.split('.'))
