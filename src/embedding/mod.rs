//! Table-batched embedding bags (TBE), row formats, EmbeddingBagCollection/EmbeddingCollection (in progress).
