"""The package version: the gateway's, so that a client and its gateway release together."""

__version__ = "0.1.0"
