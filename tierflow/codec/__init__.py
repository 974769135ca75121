"""Wire codecs: how a tensor becomes bytes on a link and back.

``base`` is the one interface (:class:`~tierflow.codec.base.EncodedTensor`, ``encode``,
``decode`` and the measured ratio and speed the cost model uses); ``spec`` parses codec
text (``int8+zstd:3``); ``stages`` is the drop/sparse/quantise/compress pipeline;
``schemes`` the quantisers and zstd; ``image`` JPEG, WebP and PNG for image inputs.
"""
