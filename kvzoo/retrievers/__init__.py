"""Retrievers: the indexes over a layer's archive that bring rows back for a step (the retrieval tier).

One module per index kind, each a :class:`~kvzoo.framework.retriever.RetrievalState` made by a configuration
registered by name (``registry.toml``): ``vestige.py`` (over ``sketch.py``, ``int8.py`` and ``paged.py``) and
``quest.py``. Any selector combines with any retriever; the framework never imports this package (the registry does).
"""
