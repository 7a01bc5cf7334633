"""Retrievers: the indexes over a layer's archive that bring rows back for a step (the retrieval tier).

One module per index kind, each a :class:`~kvzoo.framework.retriever.RetrievalState` made by a retriever
configuration registered by name (``registry.toml``):

* ``vestige.py`` -- :class:`VestigeRetriever` (``"vestige"``), whose index kind follows the rows' layout:
  ``sketch.py`` (the certified low-rank sketch; MLA's default), ``int8.py`` (int8 keys; GQA's default, and the
  per-row entries and selection rule the three share), ``paged.py`` (int8 keys under a page summary);
* ``quest.py`` -- :class:`QuestRetriever` (``"quest"``): pages with element-wise key min/max, in the page summary
  the paged int8 index shares.

Any selector combines with any retriever (``registry.get("snapkv", retriever="vestige")``). This package imports
the policy layer, the storage primitive and the kernels; the framework never imports it (retrievers reach it through
the registry).
"""
