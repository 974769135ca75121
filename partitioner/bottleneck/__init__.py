"""Learned bottlenecks: a trained encoder/decoder pair grafted at a cut, so fewer bytes cross.

``tierflow bottleneck add`` (:mod:`.commands`) runs :func:`.add.add_bottleneck`: it picks
the cut, gets the features and the exact outputs from ONNX Runtime, has a trainer fit
each (channels, bits) point, grafts it (:mod:`.graft`) and measures it on held-out
requests. Everything here needs onnx only (the ``plan`` extra); the trainer is torch's
(:mod:`tierflow.zoo.bottleneck_train`, the ``train`` extra), handed in by the command.
"""
