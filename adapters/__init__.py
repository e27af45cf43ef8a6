"""First-party layergraph adapters, installed as ``layergraph_adapters``.

Each module is a plugin of the entry-point group ``layergraph``, loaded exactly like a third
party's. A module imports its model framework (timm, transformers) only when one of its
adapters is used, never when the plugin is loaded.
"""
