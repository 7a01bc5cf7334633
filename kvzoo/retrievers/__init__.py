"""Retrievers: the indexes over a layer's archive that bring rows back for a step (the retrieval tier).

One module per index kind, each a :class:`~kvzoo.framework.retriever.RetrievalState` made by a retriever
configuration registered by name (``registry.toml``):

* ``vestige.py`` -- :class:`VestigeRetriever` (``"vestige"``), whose index kind follows the rows' layout:
  ``sketch.py`` (the certified low-rank sketch; MLA's default), ``int8.py`` (int8 keys; GQA's default),
  ``paged.py`` (int8 keys under a page summary); ``entries.py`` is what the three share;
* ``quest.py`` -- :class:`QuestRetriever` (``"quest"``): pages with element-wise key min/max;
* ``pages.py`` -- the page summary Quest's index and the paged int8 index share.

Any selector combines with any retriever (``registry.get("snapkv", retriever="vestige")``). This package imports
the policy layer, the storage primitive and the kernels; the framework never imports it (retrievers reach it through
the registry).
"""
