"""Precision methods, one folder each (``snip``, ...). A method plugs into training only
through the seams of :mod:`megatron_ext.extension` and the registries of
:mod:`megatron_ext.precision`; methods never import each other (docs/architecture.md)."""
