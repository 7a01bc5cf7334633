"""The retrieval tier's public names in one place: the interfaces (``framework/retriever.py``) and
building a retriever by name (``framework/names.py``)."""

from kvzoo.framework.names import build_retriever, retriever_names
from kvzoo.framework.retriever import ArchiveView, Choice, RetrievalState, Retriever, RowGeometry

__all__ = ["ArchiveView", "Choice", "RetrievalState", "Retriever", "RowGeometry", "build_retriever", "retriever_names"]
