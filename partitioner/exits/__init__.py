"""Early exits: classifier heads grafted onto a model, calibrated, and planned.

``tierflow exits add`` (:mod:`.commands`) runs :func:`.add.add_exits`: it picks exit
points (:mod:`.points`), trains and grafts heads (:mod:`.heads`), calibrates their
thresholds (:mod:`.calibration`) and records them in the model (:mod:`.metadata`).
``tierflow plan`` reads them back: :mod:`.plan` analyses the model's trunk and attaches
the heads to the segments, and :mod:`.cost` gives the expected compute the planner
weighs. Everything here needs onnx (the ``plan`` extra); training heads also needs
scikit-learn (the ``train`` extra).
"""
